"""Quantized experts for ONNX Runtime's QMoE (docs/MOE.md): per expert, the symmetric MatMulNBits bytes
of each [N, K] weight laid out [E, N, K*bits/8] (weights_prepacked=0), scales [E, N, K/block] (block-wise)
or [E, N] (one scale per output row, `block` 0); W = (q - 2^(bits-1)) * scale.

Which blocks (measured with ORT 1.32's CPU kernel, docs/MOE.md): block-wise experts run int8 dot-product
kernels (activations quantized to int8: always for int8, at accuracy_level 4 for int4) and are 10-15x
faster than one scale per row, which dequantizes the experts on every call (as slow as float) but keeps
float activations (exact against the dequantized weights). So experts use the largest block up to the
scheme's group size that divides both the hidden and the expert intermediate size (QMoE's requirement);
one scale per row only where none does, or for int8 at accuracy_level 0 (float activations asked for).

Experts stored quantized (a GGUF file's Q4_0 / Q8_0 / ... `ffn_*_exps`, builder/gguf/checkpoint.py GGUFExperts)
keep their integers: `stored_layout` finds the (bits, block) that holds a layer's gate/up and down exactly and
`ImportedExperts` hands out their arrays in it, never rounding again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from builder.quant.schemes import QuantizedArrays, QuantScheme, fake_quantize, quantize
from builder.quant.weights import PartsOnce
from builder.weights import Concat, WeightSource


def expert_block(scheme: QuantScheme, hidden: int, inter: int, accuracy_level: int) -> int:
    """The QMoE block_size for these experts (0: one scale per output row)."""
    if scheme.bits == 8 and accuracy_level == 0:
        return 0
    return next((b for b in (256, 128, 64, 32, 16) if b <= scheme.group_size and not hidden % b and not inter % b), 0)


@dataclass(eq=False)
class ExpertQuantizer(PartsOnce):
    """Quantizes a stacked [E, N, K] source expert by expert on first request; its parts ("q", "scales")
    are `QuantizedWeight`s (builder/quant/weights.py)."""

    source: WeightSource
    bits: int
    block: int

    def parts(self) -> tuple[str, ...]:
        return "q", "scales"

    def shape(self, part: str) -> tuple[int, ...]:
        experts, n, k = self.source.shape
        return (experts, n, k * self.bits // 8) if part == "q" else (experts, n, k // self.block) if self.block \
            else (experts, n)

    def label(self) -> str:
        return f"experts_quant{self.bits}_b{self.block or 'row'}"

    def _one(self, w: np.ndarray) -> QuantizedArrays:
        return quantize(w, self.bits, self.block or w.shape[1])

    def make(self) -> dict[str, np.ndarray]:
        parts = [self._one(w) for w in self.source.materialize()]
        return {"q": np.stack([p.q.reshape(p.q.shape[0], -1) for p in parts]),
                "scales": np.stack([p.scales if self.block else p.scales[:, 0] for p in parts])}

    def dequantized(self) -> np.ndarray:
        """The float [E, N, K] the kernel computes with (for references and tests)."""
        return np.stack([fake_quantize(w, self.bits, self.block or w.shape[1]) for w in self.source.materialize()])


def stored_layout(sources: list[WeightSource]) -> tuple[int, int] | None:
    """The (bits, block) in which every stacked expert source holds its stored integers exactly (the most bits
    and the smallest block among them, builder/gguf/checkpoint.py GGUFExperts), or None where one is float or
    its format has no such form (a block minimum)."""
    leaves = [leaf for source in sources for leaf in _leaves(source)]
    layouts = [getattr(leaf, "expert_layout", lambda: None)() for leaf in leaves]
    if not leaves or None in layouts:
        return None
    bits, block = max(b for b, _ in layouts), min(k for _, k in layouts)
    return (bits, block) if all(k % block == 0 for _, k in layouts) else None


def _leaves(source: WeightSource) -> list[WeightSource]:
    if isinstance(source, Concat):
        return [leaf for part in source.parts for leaf in _leaves(part)]
    part = getattr(source, "part", None)  # trace_moe.ExpertLayout
    return [source] if part is None or getattr(source, "swap", False) else _leaves(part)


def stored_arrays(source: WeightSource, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(q [E, N, K * bits / 8], scales [E, N, K / block]) of a stacked expert source from its stored integers,
    rows arranged as the source arranges them (gate/up interleaved)."""
    if isinstance(source, Concat):  # rows joined: [gate | up]
        parts = [stored_arrays(p, bits, block) for p in source.parts]
        return np.concatenate([q for q, _ in parts], axis=1), np.concatenate([s for _, s in parts], axis=1)
    if hasattr(source, "arrange"):
        q, scales = stored_arrays(source.part, bits, block)
        return source.arrange(q), source.arrange(scales)
    return source.expert_arrays(bits, block)


@dataclass(eq=False)
class ImportedExperts(PartsOnce):
    """A stacked [E, N, K] expert source whose stored integers QMoE reads as they are (`stored_layout`); its
    parts ("q", "scales") are `QuantizedWeight`s. The reference holds the same values (the file's)."""

    source: WeightSource
    bits: int
    block: int
    reference_loads = True

    def parts(self) -> tuple[str, ...]:
        return "q", "scales"

    def shape(self, part: str) -> tuple[int, ...]:
        experts, n, k = self.source.shape
        return (experts, n, k * self.bits // 8) if part == "q" else (experts, n, k // self.block)

    def label(self) -> str:
        return f"experts_stored{self.bits}_b{self.block}"

    def make(self) -> dict[str, np.ndarray]:
        return dict(zip(("q", "scales"), stored_arrays(self.source, self.bits, self.block)))
