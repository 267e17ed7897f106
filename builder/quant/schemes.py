"""Weight quantization schemes and the numpy quantizer that writes ONNX Runtime's MatMulNBits layout.

A scheme is a named frozen dataclass in `SCHEMES`; the recipe's `quantization.mode` picks one and may
override its group size (int4) and symmetry. The layout (ORT_NOTES.md, MatMulNBits) for a weight W [N, K]
in blocks of `block` along K, blocks = ceil(K / block):

    q            uint8 [N, blocks, block*bits/8]   4 bits: element 2i low nibble, 2i+1 high
    scales       float [N, blocks]
    zero_points  uint8 [N, ceil(blocks*bits/8)]    same nibble order; absent = 2^(bits-1) (symmetric)
    W ~ (q - zero_point) * scale

A K that the block does not divide ends in a partial block: its scale and zero point come from its real
values only and its padding bytes are zero. MatMulNBits reads only K values per row (measured with ORT
1.31 at accuracy levels 0 and 4 against numpy dequantize-then-matmul, K from 1 to 688), so every 2-D
weight can be quantized with any block size.

Rounding follows MLAS (MlasQuantizeBlockwise) so the bytes match `quantize_matmul_4bits/8bits`:
symmetric scale = the block's largest-magnitude value / -2^(bits-1); asymmetric over [min(w,0), max(w,0)]."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from runtime.manifest.arith import ceil_div


MATMUL_NBITS_BLOCKS = (16, 32, 64, 128, 256)  # the block sizes MatMulNBits accepts (ORT 1.31)
# int8's block: 32, llama.cpp q8_0's. Level 4 quantizes the activations in blocks of the weight's block too, and
# on a real model (SmolLM2-135M, activation outliers) blocks of 256 cost +1.7% perplexity against transformers
# (KL 0.0144 / token), 64 +0.9% (0.0075), 32 +0.4% (0.0044); 32 also decoded 1.3x faster than 256 there (K 576
# is not a multiple of 256: a quarter of the last block is padding), contended (docs/ACCURACY.md, "int8's
# block"). On large weights whose K 256 divides, 256 was 1.0-1.8x faster than 32 at M = 1/16/128 (weights
# 4096x4096, 11008x4096, 4096x11008; ORT_NOTES.md), the speed 32 gives up there for its accuracy. Blocks of 16
# (`quantization.group_size: 16`, the recipe's block for int8 too) cut SmolLM2's loss to +0.43% from +0.66% at the
# same batch-1 speed, but prefill ran 0.81x q8_0 against 0.99x (docs/ACCURACY.md, "int4 on SmolLM2", its int8
# paragraph): an opt-in. The 8-bit lm_head of a 4-bit build (`lm_head: auto`) keeps INT8_BLOCK whatever the
# recipe's group_size.
INT8_BLOCK = 32
# The recipe's default quantization.group_size, int4's block (and int8's, = INT8_BLOCK): 32, llama.cpp q4_0's. On
# SmolLM2-135M, round-to-nearest at 32 matched q4_0's perplexity (+26%) where 128 lost +39% (docs/ACCURACY.md,
# "int4 on SmolLM2"); on this AVX2 box 32 ran 7B shapes (4096x4096, 11008x4096, 4096x11008) as fast as 128 at M 8
# and faster at M 1, and SmolLM2's faster (K 576 pads to 640 in blocks of 128): tools/bench/matmul_nbits.py. It
# costs bytes: float32 scales make it 5 bits a weight against 4.25 at 128 (4.5 in a float16 graph, q4_0's size).
INT4_BLOCK = 32
DEFAULT_ACCURACY_LEVEL = {"cpu": 4, "cuda": 0}  # CPU: int8 activations (8-bit at level 0 is 25-40x slower)


@dataclass(frozen=True)
class QuantScheme:
    """One weight-only quantization recipe.

    `group_size` is the MatMulNBits block along K for every weight (a K it does not divide ends in a
    zero-padded partial block); `group_from_recipe` False keeps it fixed whatever the recipe's
    `quantization.group_size` says. `awq` adds activation-aware scales (SearchAWQScales); `gptq` solves
    the integer weights with GPTQ's error feedback on calibration inputs (SolveGPTQ) instead of rounding
    each to nearest."""

    name: str
    bits: int
    group_size: int
    symmetric: bool = True
    awq: bool = False
    gptq: bool = False
    group_from_recipe: bool = True
    doc: str = ""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"scheme {self.name}: bits must be 4 or 8, got {self.bits}")
        if self.group_size not in MATMUL_NBITS_BLOCKS:
            raise ValueError(f"scheme {self.name}: group_size {self.group_size} is not one of {MATMUL_NBITS_BLOCKS}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SCHEMES: dict[str, QuantScheme] = {
    "int8": QuantScheme("int8", 8, INT8_BLOCK,
                        doc="symmetric, blocks of group_size along K (default 32; per output channel for a K no larger)"),
    "int4_rtn": QuantScheme("int4_rtn", 4, INT4_BLOCK, doc="group-wise round-to-nearest"),
    "int4_awq": QuantScheme("int4_awq", 4, INT4_BLOCK, awq=True,
                            doc="group-wise, activation-aware per-input-channel scales (AWQ) folded into "
                                "the preceding norm or linear, then round-to-nearest"),
    "int4_gptq": QuantScheme("int4_gptq", 4, INT4_BLOCK, gptq=True,
                             doc="group-wise GPTQ: columns quantized one at a time (by default in descending "
                                 "Hessian diagonal order, act_order), each one's rounding error compensated on "
                                 "the columns after it (Hessian of calibration inputs)"),
    "int8_gptq": QuantScheme("int8_gptq", 8, INT8_BLOCK, gptq=True, doc="8-bit group-wise GPTQ"),
}


class QuantOptions(Protocol):
    """What quantization reads from a build's options (builder.recipe.Quantization is one): the quant
    package depends on this shape, not on the recipe module above it."""

    mode: str
    group_size: int
    symmetric: bool
    exclude: list[str]
    lm_head: str  # auto | same | int8 | none
    damp: float  # GPTQ: dampening, a fraction of the mean Hessian diagonal
    act_order: bool  # GPTQ: columns in descending Hessian diagonal order
    activation_block: int | str | dict[str, int] | None  # the block int8 activations round in, or `auto`


def scheme_for(options: QuantOptions) -> QuantScheme:
    """The registry scheme for `options.mode`, with the recipe's group size (int4) and symmetry."""
    base = SCHEMES[options.mode]
    group = options.group_size if base.group_from_recipe else base.group_size
    return dataclasses.replace(base, group_size=group, symmetric=options.symmetric)


class QuantizedArrays(NamedTuple):
    q: np.ndarray                     # uint8 [N, blocks, block*bits/8], blocks = ceil(K/block)
    scales: np.ndarray                # float32 [N, blocks]
    zero_points: np.ndarray | None    # uint8 [N, ceil(blocks*bits/8)], None when symmetric


def quantize(w: np.ndarray, bits: int, block: int, symmetric: bool = True) -> QuantizedArrays:
    """Quantize W [N, K] into MatMulNBits' layout; a partial last block is zero-padded."""
    n, k = w.shape
    blocks = ceil_div(k, block)
    padded = np.zeros((n, blocks * block), np.float32)  # zeros leave both ranges of a block unchanged
    padded[:, :k] = w
    padded = padded.reshape(n, blocks, block)
    scales, zp = (_symmetric_range if symmetric else _asymmetric_range)(padded, bits)
    inverse = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales != 0)
    q = np.floor(padded * inverse[..., None] + zp[..., None].astype(np.float32) + np.float32(0.5))
    q = np.clip(q, 0, 2**bits - 1).astype(np.uint8).reshape(n, blocks * block)
    q[:, k:] = 0  # padding bytes are zero, as ORT's quantize_matmul_Nbits leaves them
    q = q.reshape(n, blocks, block)
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


def dequantize(arrays: QuantizedArrays, bits: int, block: int, k: int | None = None) -> np.ndarray:
    """W [N, K] = (q - zero_point) * scale, the value MatMulNBits multiplies with; K defaults to
    blocks * block (pass the real K of a weight whose last block is padded)."""
    q, scales, zp = arrays
    n, blocks = scales.shape
    values = unpack(q, bits, block).astype(np.float32)  # [N, blocks, block]
    zero = (np.float32(2 ** (bits - 1)) if zp is None
            else unpack(zp, bits, blocks).astype(np.float32)[..., None])
    return ((values - zero) * scales[..., None]).reshape(n, blocks * block)[:, :k]


def fake_quantize(w: np.ndarray, bits: int, block: int, symmetric: bool = True) -> np.ndarray:
    """quantize then dequantize: the weight the engine effectively uses."""
    return dequantize(quantize(w, bits, block, symmetric), bits, block, w.shape[1])
