"""The mixture-of-experts part of the front end: a sparse layer's MLP as one IR `MoE` node (router,
stacked expert weights as lazy references into the checkpoint), plus Qwen2-MoE's shared expert as plain
Linear ops with its sigmoid gate, and the lazy transforms that put HF's stacked expert tensors into the
IR layout (gate_up [E, 2I, H] with gate/up rows interleaved, down [E, H, I])."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from builder.spec import ModelSpec
from builder.weights import Checkpoint, CheckpointError, Concat, WeightSource

EXPERT_WEIGHTS = ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias")


def expert_source(spec: ModelSpec, key: str, param: str, source: WeightSource) -> WeightSource:
    """HF's stored expert tensor `key` (the model's parameter `param`) in the IR layout; every other
    weight unchanged."""
    name = key.rsplit(".", 1)[-1]
    if name not in EXPERT_WEIGHTS:
        return source
    transposed = spec.moe["experts_layout"] == "in_out_interleaved"  # gpt-oss: [E, H, 2I], already interleaved
    return ExpertLayout(source, param, swap=transposed and name in ("experts_gate_up", "experts_down"),
                        interleave=not transposed and name in ("experts_gate_up", "experts_gate_up_bias"))


def stored_sources(spec: ModelSpec, hp: dict, names: dict[str, str], checkpoint: Checkpoint,
                   skeleton: Any) -> dict[str, WeightSource]:
    """IR key -> lazy source for the MoE weights a checkpoint stores in the hub's form rather than under the
    model's parameter name (`moe.stored` in the spec): a renamed tensor (Mixtral's block_sparse_moe.gate), or
    one tensor per expert, its parts (gate, up) joined along rows and the experts stacked: [E, rows, cols],
    or MXFP4 blocks and scales (gpt-oss), dequantized at build (Mxfp4Experts)."""
    available, stored = checkpoint.names(), spec.moe.get("stored", {})
    sources: dict[str, WeightSource] = {}
    for key, hf in names.items():
        if hf in available or not key.startswith("layers.") or key.rsplit(".", 1)[-1] not in stored:
            continue
        layer, name = key.split(".")[1], key.rsplit(".", 1)[-1]
        prefix = spec.weights["layer_prefix"].format(layer=layer)
        pattern = stored[name]
        if pattern == "mxfp4":  # gpt-oss: <param>_blocks and <param>_scales, dequantized here
            source: WeightSource = Mxfp4Experts(checkpoint, hf)
        elif isinstance(pattern, str):
            source = checkpoint.source(prefix + pattern)
        else:
            source = Stacked([_expert(checkpoint, [prefix + p.format(expert=e) for p in pattern])
                              for e in range(int(hp["num_experts"]))])
        want = tuple(skeleton.get_parameter(hf).shape)
        if tuple(source.shape) != want:
            raise CheckpointError(f"{checkpoint.path}: {source} has shape {list(source.shape)}, expected {list(want)} "
                                  f"(the model's {hf}) from config.json")
        sources[key] = source
    return sources


def _expert(checkpoint: Checkpoint, names: list[str]) -> WeightSource:
    missing = [n for n in names if n not in checkpoint.names()]
    if missing:
        raise CheckpointError(f"{checkpoint.path}: checkpoint lacks tensors the model needs: {missing[:8]}")
    parts = [checkpoint.source(n) for n in names]
    return parts[0] if len(parts) == 1 else Concat(parts)


def routed_mlp(block: Any, h: str, p: str) -> str:
    """x [b, s, H] -> the routed experts' sum (+ the sigmoid-gated shared expert where the layer has one)."""
    g, w, hp, moe = block.g, block.w, block.hp, block.spec.moe
    shape = ("batch", "seq", hp["hidden_size"])
    normalize = moe["normalize"] if isinstance(moe["normalize"], bool) else bool(hp[moe["normalize"]])
    attrs = dict(top_k=int(hp["experts_per_token"]), normalize=normalize, activation=moe["activation"])
    if moe["activation"] == "clamped_swiglu":
        attrs.update(alpha=float(hp["swiglu_alpha"]), limit=float(hp["swiglu_limit"]))
    inputs = [h, w[p + "router"], w[p + "experts_gate_up"], w[p + "experts_down"],
              w.get(p + "router_bias", ""), w.get(p + "experts_gate_up_bias", ""), w.get(p + "experts_down_bias", "")]
    while not inputs[-1]:
        inputs.pop()
    y = g.make("MoE", inputs, shape, "float32", "moe", **attrs)
    if p + "shared_expert_gate" not in w:
        return y
    shared = block.gated_mlp(h, p + "shared_", hp["shared_intermediate_size"])
    score = g.make("Activation", [block.linear(h, p + "shared_expert_gate", 1)], ("batch", "seq", 1), "float32",
                   "shared_gate", fn="sigmoid")
    return g.make("Add", [y, g.make("Mul", [shared, score], shape, "float32", "shared")], shape, "float32", "moe_out")


@dataclass(eq=False)
class ExpertLayout(WeightSource):
    """A stacked expert tensor, the model's parameter `param`, in the IR layout: `swap` reads [E, in, out]
    as [E, out, in] (gpt-oss), `interleave` reads [gate | up] rows (axis 1) as gate 0, up 0, gate 1, ...
    `to_parameter` maps an IR-layout value back (for references that load it into transformers)."""

    part: WeightSource
    param: str
    swap: bool = False
    interleave: bool = False

    def __post_init__(self) -> None:
        shape = tuple(self.part.shape)
        self.shape, self.dtype = (shape[0], shape[2], shape[1]) if self.swap else shape, self.part.dtype

    def materialize(self) -> np.ndarray:
        array = self.part.materialize()
        return self.arrange(np.swapaxes(array, 1, 2) if self.swap else array)

    def arrange(self, array: np.ndarray) -> np.ndarray:
        """Rows (axis 1) of [E, rows, ...] in the IR order: also a stored form's integers and block scales."""
        if self.interleave:  # [E, 2, I, ...] -> [E, I, 2, ...]
            array = np.swapaxes(array.reshape(array.shape[0], 2, -1, *array.shape[2:]), 1, 2).reshape(array.shape)
        return np.ascontiguousarray(array)

    def to_parameter(self, value: np.ndarray) -> np.ndarray:
        if self.interleave:
            value = np.swapaxes(value.reshape(value.shape[0], -1, 2, *value.shape[2:]), 1, 2).reshape(value.shape)
        return np.ascontiguousarray(np.swapaxes(value, 1, 2) if self.swap else value)

    def __str__(self) -> str:
        return f"{'swap_last_axes(' if self.swap else ''}{'interleave_gate_up(' if self.interleave else ''}" \
               f"{self.part}{')' * (self.swap + self.interleave)}"


@dataclass(eq=False)
class Stacked(WeightSource):
    """Equal-shaped per-expert tensors stacked on a new first axis: [E, ...]."""

    parts: list[WeightSource]

    def __post_init__(self) -> None:
        self.shape, self.dtype = (len(self.parts),) + tuple(self.parts[0].shape), self.parts[0].dtype

    def materialize(self) -> np.ndarray:
        return np.stack([p.materialize() for p in self.parts])

    def __str__(self) -> str:
        return f"stack({self.parts[0]}, ... {len(self.parts)} experts)"


FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)  # E2M1


@dataclass(eq=False)
class Mxfp4Experts(WeightSource):
    """gpt-oss's MXFP4 experts, `param`_blocks uint8 [E, out, in/32, 16] (two E2M1 values a byte, low nibble
    first) and `param`_scales uint8 [E, out, in/32] (E8M0: 2^(s - 127) per 32 values), dequantized to float32
    and read as the model's parameter [E, in, out]. Dequantized at build: ONNX Runtime's QMoE takes MXFP4
    (quant_type fp4) on CUDA only, and its CPU kernel has no FP4 path (docs/MOE.md); the recipe's
    quantization (int4/int8 QMoE) can then re-quantize the experts."""

    checkpoint: Checkpoint
    param: str

    def __post_init__(self) -> None:
        experts, out, groups, half = self.checkpoint.shape(self.param + "_blocks")
        self.shape, self.dtype = (experts, groups * half * 2, out), "float32"

    def materialize(self) -> np.ndarray:
        blocks = self.checkpoint.read(self.param + "_blocks")                  # [E, out, G, 16] uint8
        exponents = self.checkpoint.read(self.param + "_scales").astype(np.int32) - 127  # [E, out, G]
        values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], -1)  # [E, out, G, 16, 2]
        values = np.ldexp(values.reshape(*blocks.shape[:3], -1), exponents[..., None])  # [E, out, G, 32]
        return np.ascontiguousarray(np.swapaxes(values.reshape(*blocks.shape[:2], -1), 1, 2), dtype=np.float32)

    def __str__(self) -> str:
        return f'mxfp4(ckpt["{self.param}_blocks"], ckpt["{self.param}_scales"])'
