"""Lowering of the IR's MoE and QuantMoE ops to ONNX Runtime's com.microsoft MoE and QMoE (docs/MOE.md
has what the installed CPU kernel supports, measured). The router is a float MatMul outside the kernel
(router_probs takes the logits; the kernel applies the softmax and top-k), so a quantized engine keeps its
router float; the expert weights go to the kernel in the IR layout: gate_up [E, 2I, H] interleaved,
which is the only SwiGLU layout (swiglu_fusion=1) ORT 1.32's CPU kernel accepts."""
from __future__ import annotations

import numpy as np

from builder.ir import Node

MS = "com.microsoft"


class MoELowering:
    """Mixed into builder.lower_onnx.Lowering (uses its _emit, _weight and _const)."""

    def _router_logits(self, n: Node, bias: str) -> str:
        """logits [b * s, E] = x @ router.T (+ bias), float."""
        x, router, y = n.inputs[0], n.inputs[1], n.outputs[0]
        experts = self.g.values[router].shape[0]
        self._emit("MatMul", [x, self._weight(router, np.transpose, ".T")], [y + ".router"])
        if bias:
            self._emit("Add", [y + ".router", self._weight(bias)], [y + ".router_biased"])
        flat = self._const(f"shape.tokens_{experts}", np.array([-1, experts], dtype=np.int64))
        self._emit("Reshape", [y + (".router_biased" if bias else ".router"), flat], [y + ".logits"])
        return y + ".logits"

    def _lower_MoE(self, n: Node) -> None:
        x, _, gate_up, down, router_bias, gate_up_bias, down_bias = (n.inputs + [""] * 3)[:7]
        logits = self._router_logits(n, router_bias)
        weights = [self._weight(gate_up), self._optional(gate_up_bias), self._weight(down), self._optional(down_bias)]
        self._emit("MoE", [x, logits] + weights, n.outputs, domain=MS, **_moe_attrs(n))

    def _lower_QuantMoE(self, n: Node) -> None:
        x, _, q1, s1, q2, s2, router_bias, gate_up_bias, down_bias = (n.inputs + [""] * 3)[:9]
        logits = self._router_logits(n, router_bias)
        attrs = dict(_moe_attrs(n), expert_weight_bits=int(n.attrs["bits"]), weights_prepacked=0,
                     accuracy_level=int(n.attrs["accuracy_level"]))
        if n.attrs["block_size"]:
            attrs["block_size"] = int(n.attrs["block_size"])
        weights = [self._weight(q1), self._weight(s1), self._optional(gate_up_bias),
                   self._weight(q2), self._weight(s2), self._optional(down_bias)]
        if n.attrs["normalize"]:
            self._emit("QMoE", [x, logits] + weights, n.outputs, domain=MS, **attrs)
            return
        # ORT 1.32's CPU QMoE renormalises the top-k weights whatever normalize_routing_weights says
        # (docs/MOE.md): y = sum(p_i / S * e_i) with S the sum of the top-k softmax probabilities, so
        # S * y is the unnormalised mixture (Qwen's norm_topk_prob false).
        y, hidden = n.outputs[0], self.g.values[x].shape[-1]
        self._emit("Reshape", [x, self._const(f"shape.tokens_{hidden}", np.array([-1, hidden], np.int64))], [y + ".x"])
        self._emit("QMoE", [y + ".x", logits] + weights, [y + ".renormalised"], domain=MS, **attrs)
        self._emit("Softmax", [logits], [y + ".probs"], axis=-1)
        k = self._const(f"topk.k_{n.attrs['top_k']}", np.array([n.attrs["top_k"]], dtype=np.int64))
        self._emit("TopK", [y + ".probs", k], [y + ".top", y + ".top_index"], axis=-1, largest=1, sorted=1)
        self._emit("ReduceSum", [y + ".top", self._const("axes.last", np.array([-1], np.int64))], [y + ".sum"],
                   keepdims=1)                                                      # S [tokens, 1]
        self._emit("Mul", [y + ".renormalised", y + ".sum"], [y + ".flat"])
        self._emit("Shape", [x], [y + ".shape"])
        self._emit("Reshape", [y + ".flat", y + ".shape"], [y])

    def _optional(self, name: str) -> str:
        return self._weight(name) if name else ""


def _moe_attrs(n: Node) -> dict:
    """MoE/QMoE attributes: SwiGLU with interleaved gate/up; plain SiLU gating is alpha 1, beta 0, no
    limit; gpt-oss's clamped SwiGLU is its alpha, beta 1 and its limit."""
    attrs = dict(k=int(n.attrs["top_k"]), normalize_routing_weights=int(bool(n.attrs["normalize"])),
                 activation_type="swiglu", swiglu_fusion=1)
    if n.attrs["activation"] == "clamped_swiglu":
        return dict(attrs, activation_alpha=float(n.attrs["alpha"]), activation_beta=1.0,
                    swiglu_limit=float(n.attrs["limit"]))
    return dict(attrs, activation_alpha=1.0, activation_beta=0.0)
