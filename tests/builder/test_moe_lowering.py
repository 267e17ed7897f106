"""The MoE / QuantMoE lowering against transformers' own sparse-MoE blocks on crafted routing: ties in the
router logits, a token whose top-k includes an expert no other token uses, and batch rows routed to
disjoint experts; plus the ONNX Runtime CPU kernel facts docs/MOE.md relies on (so a new ORT that changes
them fails here first)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from builder.ir import Graph
from builder.lower_onnx import IR_VERSION, MS, OPSET, Lowering
from builder.passes.quantize_weights import QuantizeWeights
from builder.quant.experts import ExpertQuantizer
from builder.recipe import Quantization
from builder.weights import ArrayWeight

H, E, I = 32, 8, 32  # hidden, experts, expert intermediate size
SIZES = dict(hidden_size=H, intermediate_size=I, moe_intermediate_size=I, num_attention_heads=2, num_hidden_layers=1)


def hf_block(family: str, normalize: bool = True):
    """A transformers sparse-MoE block with random experts and a router that reads x[:, :E] (logit e = 4 * x[e]),
    so the routing is set by the input; returns the block and the IR weights (router, gate_up, down[, biases])."""
    torch.manual_seed(0)
    if family == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(num_local_experts=E, num_experts_per_tok=2, **SIZES))
    elif family == "qwen3_moe":
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(num_experts=E, num_experts_per_tok=2, norm_topk_prob=normalize,
                                                      **SIZES))
    else:
        block = GptOssMLP(GptOssConfig(num_local_experts=E, num_experts_per_tok=2, swiglu_limit=0.5, **SIZES))
    router = block.router if family == "gpt_oss" else block.gate
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        router.weight.zero_()
        router.weight[:, :E] = 4 * torch.eye(E)
    experts = block.experts
    if family == "gpt_oss":  # [E, H, 2I] interleaved, down [E, I, H], biases
        return block, dict(router=router.weight, gate_up=experts.gate_up_proj.transpose(1, 2),
                           down=experts.down_proj.transpose(1, 2), router_bias=router.bias,
                           gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias)
    gate, up = experts.gate_up_proj.chunk(2, dim=1)  # [gate | up] -> interleaved rows
    return block, dict(router=router.weight, gate_up=torch.stack([gate, up], 2).reshape(E, 2 * I, H),
                       down=experts.down_proj)


def run_lowered(family: str, weights: dict, x: np.ndarray, tmp_path, normalize: bool = True,
                quantize: str = "none") -> np.ndarray:
    """One IR MoE node over x [b, s, H], (optionally quantized by QuantizeWeights,) lowered and run."""
    g = Graph("moe")
    g.add_input("x", ("batch", "seq", H), "float32")
    names = {k: g.add_weight(k, ArrayWeight(v.detach().numpy().astype(np.float32).copy(), k)) for k, v in weights.items()}
    attrs = dict(top_k=2, normalize=normalize, activation="silu")
    if family == "gpt_oss":
        attrs.update(activation="clamped_swiglu", alpha=1.702, limit=0.5)
    inputs = ["x"] + [names.get(k, "") for k in ("router", "gate_up", "down", "router_bias", "gate_up_bias",
                                                 "down_bias")]
    while not inputs[-1]:
        inputs.pop()
    g.make("MoE", inputs, ("batch", "seq", H), "float32", out="y", **attrs)
    g.add_output("y")
    if quantize != "none":
        g = QuantizeWeights(Quantization(quantize, group_size=32, accuracy_level=0)).run(g)
    lowering = Lowering(g, tmp_path / "moe.onnx.data")
    for node in g.nodes:
        getattr(lowering, f"_lower_{node.op}")(node)
    lowering.writer.close()
    graph = helper.make_graph(lowering.nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], lowering.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              ir_version=IR_VERSION)
    onnx.save_model(model, str(tmp_path / "moe.onnx"))
    session = ort.InferenceSession(str(tmp_path / "moe.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def routed(rows: list[list[dict[int, float]]]) -> np.ndarray:
    """x [b, s, H]: small noise, plus x[e] = value for each {expert: value} of a token (router logit 4 * value)."""
    x = np.random.default_rng(1).normal(0, 0.05, (len(rows), len(rows[0]), H)).astype(np.float32)
    x[:, :, :E] = 0
    for b, row in enumerate(rows):
        for s, token in enumerate(row):
            for e, value in token.items():
                x[b, s, e] = value
    return x


def reference(block, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = block(torch.from_numpy(x))
    return (out[0] if isinstance(out, tuple) else out).numpy()  # GptOssMLP also returns its router scores


CASES = {
    # experts 2 and 5 tie exactly for first place, 0 is third: both tied experts are chosen, equal weights
    "tie-inside-top-k": [[{2: 1.0, 5: 1.0, 0: 0.5}, {1: 0.7, 6: 0.7}]],
    # token (0, 2) alone uses expert 7; every other token routes within 0..3
    "expert-used-by-one-token": [[{0: 1.0, 1: 0.8}, {1: 1.0, 2: 0.5}, {7: 1.2, 3: 0.9}, {3: 1.0, 0: 0.2}]],
    # batch row 0 only ever uses experts 0/1, row 1 only 4/5
    "rows-on-disjoint-experts": [[{0: 1.0, 1: 0.5}, {1: 1.0, 0: 0.3}], [{4: 1.0, 5: 0.6}, {5: 0.9, 4: 0.8}]],
}
FAMILIES = [("mixtral", True), ("qwen3_moe", False), ("gpt_oss", True)]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family,normalize", FAMILIES)
def test_routing_edge_cases_match_transformers(family, normalize, case, tmp_path):
    block, weights = hf_block(family, normalize)
    x = routed(CASES[case])
    np.testing.assert_allclose(run_lowered(family, weights, x, tmp_path, normalize), reference(block, x),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode,bits,block", [("int8", 8, 0), ("int4_rtn", 4, 32)])
@pytest.mark.parametrize("family,normalize", FAMILIES)
def test_quantized_routing_matches_transformers_on_dequantized_experts(family, normalize, mode, bits, block, tmp_path):
    """QuantMoE (QMoE) on the same cases, against the block with its experts dequantized; an unnormalised
    router (Qwen3-MoE here) goes through the rescaling around QMoE, which always renormalises."""
    hf, weights = hf_block(family, normalize)
    experts = hf.experts
    with torch.no_grad():
        for name, param in (("gate_up", experts.gate_up_proj), ("down", experts.down_proj)):
            ir = weights[name].detach().numpy().astype(np.float32).copy()
            value = ExpertQuantizer(ArrayWeight(ir), bits, block).dequantized()
            if family == "gpt_oss":
                param.copy_(torch.from_numpy(np.swapaxes(value, 1, 2)))
            elif name == "gate_up":  # interleaved -> [gate | up]
                param.copy_(torch.from_numpy(value.reshape(E, I, 2, H).transpose(0, 2, 1, 3).reshape(E, 2 * I, H)))
            else:
                param.copy_(torch.from_numpy(value))
            weights[name] = torch.from_numpy(ir)
    for case in sorted(CASES):
        x = routed(CASES[case])
        got = run_lowered(family, weights, x, tmp_path, normalize, quantize=mode)
        np.testing.assert_allclose(got, reference(hf, x), atol=1e-5, rtol=0, err_msg=case)


def test_a_tie_at_the_top_k_boundary_is_implementation_defined(tmp_path):
    """Experts 1..7 tie for second place: ONNX Runtime's kernel takes the highest index (7), torch.topk
    another one; the engine cannot and does not promise transformers' pick there (docs/MOE.md)."""
    block, weights = hf_block("mixtral")
    x = routed([[{0: 1.0}]])
    x[..., :E] = [1.0] + [0.0] * (E - 1)
    got = run_lowered("mixtral", weights, x, tmp_path)
    with torch.no_grad():
        block.gate.weight[1:7] = 0  # keep only experts 0 and 7 routable: what ORT chose
        block.gate.weight[1:7, 0] = -100
        expected = block(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
