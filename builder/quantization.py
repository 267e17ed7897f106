"""Weight quantization schemes and the numpy quantizer that writes ONNX Runtime's MatMulNBits layout.

A scheme is a named frozen dataclass in `SCHEMES`; the recipe's `quantization.mode` picks one and may
override its group size and symmetry. The layout (ORT_NOTES.md, MatMulNBits) for a weight W [N, K]:

    q            uint8 [N, K/block, block*bits/8]   blocks along K; 4 bits: element 2i low nibble, 2i+1 high
    scales       float [N, K/block]
    zero_points  uint8 [N, ceil(K/block*bits/8)]    same nibble order; absent = 2^(bits-1) (symmetric)
    W ~ (q - zero_point) * scale

Rounding follows MLAS (MlasQuantizeBlockwise) so the bytes match `quantize_matmul_4bits/8bits`:
symmetric scale = the block's largest-magnitude value / -2^(bits-1); asymmetric over [min(w,0), max(w,0)]."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from builder.recipe import Quantization

MATMUL_NBITS_BLOCKS = (256, 128, 64, 32, 16)  # the block sizes MatMulNBits accepts (ORT 1.31), largest first
DEFAULT_ACCURACY_LEVEL = {"cpu": 4, "cuda": 0}  # CPU: int8 activations (8-bit at level 0 is 25-40x slower)


@dataclass(frozen=True)
class QuantScheme:
    """One weight-only quantization recipe.

    `group_size` None means per output channel: one block per row where MatMulNBits allows it, else
    the largest block it accepts that divides K. `awq` adds activation-aware scales (SearchAWQScales)."""

    name: str
    bits: int
    group_size: int | None
    symmetric: bool = True
    awq: bool = False
    doc: str = ""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"scheme {self.name}: bits must be 4 or 8, got {self.bits}")
        if self.group_size is not None and self.group_size not in MATMUL_NBITS_BLOCKS:
            raise ValueError(f"scheme {self.name}: group_size {self.group_size} is not one of {MATMUL_NBITS_BLOCKS}")

    def block_for(self, k: int) -> int | None:
        """The MatMulNBits block size for a weight with K input features, or None when none fits."""
        if self.group_size is not None:
            return self.group_size if k % self.group_size == 0 else None
        return next((b for b in MATMUL_NBITS_BLOCKS if k % b == 0), None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SCHEMES: dict[str, QuantScheme] = {
    "int8": QuantScheme("int8", 8, None, doc="per output channel, symmetric (blocks of up to 256 along K)"),
    "int4_rtn": QuantScheme("int4_rtn", 4, 128, doc="group-wise round-to-nearest"),
    "int4_awq": QuantScheme("int4_awq", 4, 128, awq=True,
                            doc="group-wise, activation-aware per-input-channel scales (AWQ) folded into "
                                "the preceding norm or linear, then round-to-nearest"),
}


def scheme_for(options: Quantization) -> QuantScheme:
    """The registry scheme for `options.mode`, with the recipe's group size (int4) and symmetry."""
    base = SCHEMES[options.mode]
    group = base.group_size if base.group_size is None else options.group_size
    return dataclasses.replace(base, group_size=group, symmetric=options.symmetric)


class QuantizedArrays(NamedTuple):
    q: np.ndarray                     # uint8 [N, K/block, block*bits/8]
    scales: np.ndarray                # float32 [N, K/block]
    zero_points: np.ndarray | None    # uint8 [N, ceil(K/block*bits/8)], None when symmetric


def quantize(w: np.ndarray, bits: int, block: int, symmetric: bool = True) -> QuantizedArrays:
    """Quantize W [N, K] (K divisible by `block`) into MatMulNBits' layout."""
    n, k = w.shape
    if k % block:
        raise ValueError(f"K={k} is not divisible by block size {block}")
    blocks = np.asarray(w, dtype=np.float32).reshape(n, k // block, block)
    scales, zp = (_symmetric_range if symmetric else _asymmetric_range)(blocks, bits)
    inverse = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales != 0)
    q = np.floor(blocks * inverse[..., None] + zp[..., None].astype(np.float32) + np.float32(0.5))
    q = np.clip(q, 0, 2**bits - 1).astype(np.uint8)
    return QuantizedArrays(pack(q, bits), scales, None if symmetric else pack(zp, bits, pad=2 ** (bits - 1)))


def _symmetric_range(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    index = np.abs(blocks).argmax(-1)[..., None]
    peak = np.take_along_axis(blocks, index, -1)[..., 0]  # signed value of largest magnitude
    mid = 2 ** (bits - 1)
    return (peak / np.float32(-mid)).astype(np.float32), np.full(peak.shape, mid, np.uint8)


def _asymmetric_range(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    low = np.minimum(blocks.min(-1), 0)
    high = np.maximum(blocks.max(-1), 0)
    top = 2**bits - 1
    scales = ((high - low) / np.float32(top)).astype(np.float32)
    safe = np.where(scales != 0, scales, 1)
    zero = np.where(scales != 0, -low / safe, 0)
    return scales, np.clip(np.floor(zero + 0.5), 0, top).astype(np.uint8)


def pack(values: np.ndarray, bits: int, pad: int = 0) -> np.ndarray:
    """Pack uint8 values along the last axis: 8 bits as is; 4 bits two per byte, element 2i low
    (an odd count is padded with `pad`; ORT pads zero points with the default 2^(bits-1))."""
    if bits == 8:
        return values.astype(np.uint8)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.full(values.shape[:-1] + (1,), pad, np.uint8)], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first `count` values along the last axis of a `pack`ed array."""
    if bits == 8:
        return packed[..., :count]
    both = np.stack([packed & 0x0F, packed >> 4], axis=-1)
    return both.reshape(packed.shape[:-1] + (-1,))[..., :count]


def dequantize(arrays: QuantizedArrays, bits: int, block: int) -> np.ndarray:
    """W [N, K] = (q - zero_point) * scale, the value MatMulNBits multiplies with."""
    q, scales, zp = arrays
    n, blocks = scales.shape
    values = unpack(q, bits, block).astype(np.float32)  # [N, K/block, block]
    zero = (np.float32(2 ** (bits - 1)) if zp is None
            else unpack(zp, bits, blocks).astype(np.float32)[..., None])
    return ((values - zero) * scales[..., None]).reshape(n, blocks * block)


def fake_quantize(w: np.ndarray, bits: int, block: int, symmetric: bool = True) -> np.ndarray:
    """quantize then dequantize: the weight the engine effectively uses."""
    return dequantize(quantize(w, bits, block, symmetric), bits, block)
