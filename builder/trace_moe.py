"""The mixture-of-experts part of the front end: a sparse layer's MLP as one IR `MoE` node (router,
stacked expert weights as lazy references into the checkpoint), plus Qwen2-MoE's shared expert as plain
Linear ops with its sigmoid gate, and the lazy transforms that put HF's stacked expert tensors into the
IR layout (gate_up [E, 2I, H] with gate/up rows interleaved, down [E, H, I])."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from builder.spec import ModelSpec
from builder.weights import Checkpoint, CheckpointError, CheckpointTensor, Concat, WeightSource

EXPERT_WEIGHTS = ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias")


def expert_source(spec: ModelSpec, key: str, source: WeightSource) -> WeightSource:
    """HF's stored expert tensor `key` -> the IR layout (unchanged for every other weight)."""
    name = key.rsplit(".", 1)[-1]
    if name not in EXPERT_WEIGHTS:
        return source
    transposed = spec.moe["experts_layout"] == "in_out_interleaved"  # gpt-oss: [E, H, 2I], already interleaved
    if name in ("experts_gate_up", "experts_down") and transposed:
        source = SwapLastAxes(source)
    if name in ("experts_gate_up", "experts_gate_up_bias") and not transposed:
        source = Interleaved(source)
    return source


def stored_sources(spec: ModelSpec, hp: dict, names: dict[str, str], checkpoint: Checkpoint,
                   skeleton: Any) -> dict[str, WeightSource]:
    """IR key -> lazy source for the MoE weights a checkpoint stores in the hub's form rather than under the
    model's parameter name (`moe.stored` in the spec): a renamed tensor (Mixtral's block_sparse_moe.gate), or
    one tensor per expert, its parts (gate, up) joined along rows and the experts stacked: [E, rows, cols]."""
    available, stored = checkpoint.names(), spec.moe.get("stored", {})
    sources: dict[str, WeightSource] = {}
    for key, hf in names.items():
        if hf in available or not key.startswith("layers.") or key.rsplit(".", 1)[-1] not in stored:
            continue
        layer, name = key.split(".")[1], key.rsplit(".", 1)[-1]
        prefix = spec.weights["layer_prefix"].format(layer=layer)
        pattern = stored[name]
        if isinstance(pattern, str):
            source: WeightSource = CheckpointTensor(checkpoint, prefix + pattern)
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
    parts = [CheckpointTensor(checkpoint, n) for n in names]
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
class Interleaved(WeightSource):
    """[E, 2I, ...] stored [gate | up] along axis 1, read with the rows interleaved (gate 0, up 0, gate 1, ...)."""

    part: WeightSource

    def __post_init__(self) -> None:
        self.shape, self.dtype = tuple(self.part.shape), self.part.dtype

    def materialize(self) -> np.ndarray:
        array = self.part.materialize()
        experts, rows = array.shape[:2]
        halves = array.reshape(experts, 2, rows // 2, *array.shape[2:])
        return np.ascontiguousarray(np.swapaxes(halves, 1, 2)).reshape(array.shape)

    def __str__(self) -> str:
        return f"interleave_gate_up({self.part})"


@dataclass(eq=False)
class SwapLastAxes(WeightSource):
    """A stacked [E, in, out] weight read as [E, out, in] (gpt-oss stores its experts transposed)."""

    part: WeightSource

    def __post_init__(self) -> None:
        e, a, b = self.part.shape
        self.shape, self.dtype = (e, b, a), self.part.dtype

    def materialize(self) -> np.ndarray:
        return np.ascontiguousarray(np.swapaxes(self.part.materialize(), 1, 2))

    def __str__(self) -> str:
        return f"swap_last_axes({self.part})"


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
