"""Quantized experts for ONNX Runtime's QMoE (docs/MOE.md): per expert, the symmetric MatMulNBits bytes
of each [N, K] weight laid out [E, N, K*bits/8] (weights_prepacked=0), scales [E, N, K/block] (block-wise)
or [E, N] (one scale per output row, `block` 0); W = (q - 2^(bits-1)) * scale.

Which blocks (measured with ORT 1.32's CPU kernel, docs/MOE.md): block-wise experts run int8 dot-product
kernels (activations quantized to int8: always for int8, at accuracy_level 4 for int4) and are 10-15x
faster than one scale per row, which dequantizes the experts on every call (as slow as float) but keeps
float activations (exact against the dequantized weights). So experts use the largest block up to the
scheme's group size that divides both the hidden and the expert intermediate size (QMoE's requirement);
one scale per row only where none does, or for int8 at accuracy_level 0 (float activations asked for).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from builder.quant.schemes import QuantizedArrays, QuantScheme, fake_quantize, quantize
from builder.quant.weights import PartsOnce
from builder.weights import WeightSource


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
