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

from dataclasses import dataclass, field

import numpy as np

from builder.quant.schemes import QuantizedArrays, QuantScheme, fake_quantize, quantize
from builder.weights import WeightSource


def expert_block(scheme: QuantScheme, hidden: int, inter: int, accuracy_level: int) -> int:
    """The QMoE block_size for these experts (0: one scale per output row)."""
    if scheme.bits == 8 and accuracy_level == 0:
        return 0
    return next((b for b in (256, 128, 64, 32, 16) if b <= scheme.group_size and not hidden % b and not inter % b), 0)


@dataclass(eq=False)
class ExpertQuantizer:
    """Quantizes a stacked [E, N, K] source expert by expert on first request; forgets the result once
    both parts were taken (the engine writer takes them one after the other)."""

    source: WeightSource
    bits: int
    block: int
    _result: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    _pending: set[str] = field(default_factory=set, repr=False)

    def shape(self, part: str) -> tuple[int, ...]:
        experts, n, k = self.source.shape
        return (experts, n, k * self.bits // 8) if part == "q" else (experts, n, k // self.block) if self.block \
            else (experts, n)

    def _one(self, w: np.ndarray) -> QuantizedArrays:
        return quantize(w, self.bits, self.block or w.shape[1])

    def take(self, part: str) -> np.ndarray:
        if self._result is None:
            parts = [self._one(w) for w in self.source.materialize()]
            q = np.stack([p.q.reshape(p.q.shape[0], -1) for p in parts])
            scales = np.stack([p.scales if self.block else p.scales[:, 0] for p in parts])
            self._result, self._pending = (q, scales), {"q", "scales"}
        array = self._result[0 if part == "q" else 1]
        self._pending.discard(part)
        if not self._pending:
            self._result = None
        return array

    def dequantized(self) -> np.ndarray:
        """The float [E, N, K] the kernel computes with (for references and tests)."""
        return np.stack([fake_quantize(w, self.bits, self.block or w.shape[1]) for w in self.source.materialize()])


@dataclass(eq=False)
class QuantizedExperts(WeightSource):
    """One part ("q" or "scales") of quantized stacked experts."""

    quantizer: ExpertQuantizer
    part: str

    def __post_init__(self) -> None:
        self.shape = self.quantizer.shape(self.part)
        self.dtype = "uint8" if self.part == "q" else "float32"

    def materialize(self) -> np.ndarray:
        return self.quantizer.take(self.part)

    def __str__(self) -> str:
        quant = self.quantizer
        return f"experts_quant{quant.bits}_b{quant.block or 'row'}.{self.part}({quant.source})"
