"""GGUF block types -> MatMulNBits arrays, bit-exactly (never dequantized and rounded again).

Every supported block type dequantizes, per sub-block of 16 or 32 values, as w = s * c (+ m), with c a
small integer code, s a float32 scale and m a float32 minimum (the types with one: Q4_1, Q5_1, Q2_K,
Q4_K, Q5_K). Each sub-block becomes one MatMulNBits block (../shared/ORT_NOTES.md, MatMulNBits):

    type   bits  block  stored code       zero point      minimum
    Q4_0   4     32     q (0..15)         8 (default)     -
    Q4_1   4     32     q (0..15)         0 (explicit)    m
    Q5_0   8     32     q + 112           128 (default)   -
    Q5_1   8     32     q + 128           128 (default)   m
    Q8_0   8     32     q + 128 (int8)    128 (default)   -
    Q2_K   4     16     q + 8 (0..3)      8 (default)     -dmin * m
    Q3_K   4     16     q + 8 (-4..3)     8 (default)     -
    Q4_K   4     32     q (0..15)         0 (explicit)    -dmin * m
    Q5_K   8     32     q + 128 (0..31)   128 (default)   -dmin * m
    Q6_K   8     16     q + 96 (0..63)    128 (default)   -

so (code - zero point) is the type's own integer and the scale is the float32 product the `gguf`
package's dequantize computes (d, or d * sub-block scale), in the same order: (code - zp) * s (+ m) is
then its value bit for bit. The minimum is not part of MatMulNBits: builder/passes/add_block_minimums.py
adds its term, (x summed per block) @ M. F32, F16 and BF16 tensors are read as float32 exactly. Any other
type (IQ*, TQ*, ...) is refused by name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from builder.quant.schemes import QuantizedArrays, pack

QK_K = 256


class Blocks(NamedTuple):
    """One tensor's blocks unpacked: codes uint8 [blocks, values], scales and mins float32 [blocks, subs]."""

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None


@dataclass(frozen=True)
class BlockType:
    """How one GGML block type maps onto MatMulNBits (see the module's table)."""

    name: str
    bits: int
    block: int  # values per sub-block: the MatMulNBits block
    symmetric: bool  # True: the default zero point 2^(bits-1); False: explicit zero points 0
    unpack: Callable[[np.ndarray], Blocks]
    minimum: bool = False  # blocks carry a float minimum (w = s * c + m)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Low nibbles of each run of `group` bytes, then their high nibbles (GGML's 4-bit order)."""
    n = qs.shape[0]
    both = qs.reshape(n, -1, 1, group) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (both & np.uint8(0x0F)).reshape(n, -1)


def _bits(raw: np.ndarray, count: int) -> np.ndarray:
    """Bit j (0..count-1) of the little-endian bytes `raw`, as uint8 [blocks, count]."""
    return np.unpackbits(np.ascontiguousarray(raw), axis=-1, count=count, bitorder="little")


def _q4_0(b: np.ndarray) -> Blocks:
    return Blocks(_nibbles(b[:, 2:], 16), _f16(b[:, :2]), None)


def _q4_1(b: np.ndarray) -> Blocks:
    return Blocks(_nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4]))


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    return _nibbles(qs, 16) | (_bits(qh, 32) << np.uint8(4))


def _q5_0(b: np.ndarray) -> Blocks:
    return Blocks(_five_bits(b[:, 2:6], b[:, 6:]) + np.uint8(112), _f16(b[:, :2]), None)


def _q5_1(b: np.ndarray) -> Blocks:
    return Blocks(_five_bits(b[:, 4:8], b[:, 8:]) + np.uint8(128), _f16(b[:, :2]), _f16(b[:, 2:4]))


def _q8_0(b: np.ndarray) -> Blocks:
    return Blocks(b[:, 2:] ^ np.uint8(0x80), _f16(b[:, :2]), None)


def _q2_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = d * (scales & 0xF).astype(np.float32)
    ml = dmin * (scales >> 4).astype(np.float32)
    q = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    return Blocks(q.reshape(n, QK_K) + np.uint8(8), dl, -ml)


def _q3_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & np.uint8(0x0F)) | ((high & np.uint8(0x03)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = d * sc.astype(np.float32)
    ql = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    qh = (hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
    # value = ql - 4 where the high bit is clear, ql where it is set; stored + 8 (0..11)
    codes = ql.reshape(n, QK_K) + (qh.reshape(n, QK_K) << np.uint8(2)) + np.uint8(4)
    return Blocks(codes, dl, None)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (d * sc, -(dmin * m), the rest of the block) with gguf's own 6-bit scale unpacking."""
    from gguf.quants import Q4_K

    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32)), b[:, 16:]


def _q4_k(b: np.ndarray) -> Blocks:
    scales, mins, qs = _k_scales(b)
    return Blocks(_nibbles(qs, 32), scales, mins)


def _q5_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    scales, mins, rest = _k_scales(b)
    qh, qs = rest[:, :32], rest[:, 32:]
    high = (qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
    codes = _nibbles(qs, 32) | (high.reshape(n, QK_K) << np.uint8(4))
    return Blocks(codes + np.uint8(128), scales, mins)


def _q6_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    high = ((qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3))
    codes = (low | (high.reshape(n, -1, 32) << np.uint8(4))).reshape(n, QK_K)
    return Blocks(codes + np.uint8(96), d * np.ascontiguousarray(sc).view(np.int8).astype(np.float32), None)


BLOCK_TYPES = {t.name: t for t in (
    BlockType("Q4_0", 4, 32, True, _q4_0), BlockType("Q4_1", 4, 32, False, _q4_1, minimum=True),
    BlockType("Q5_0", 8, 32, True, _q5_0), BlockType("Q5_1", 8, 32, True, _q5_1, minimum=True),
    BlockType("Q8_0", 8, 32, True, _q8_0),
    BlockType("Q2_K", 4, 16, True, _q2_k, minimum=True), BlockType("Q3_K", 4, 16, True, _q3_k),
    BlockType("Q4_K", 4, 32, False, _q4_k, minimum=True), BlockType("Q5_K", 8, 32, True, _q5_k, minimum=True),
    BlockType("Q6_K", 8, 16, True, _q6_k),
)}
FLOAT_TYPES = ("F32", "F16", "BF16")
DEQUANTIZED_TYPES = ("MXFP4",)  # read exactly as float32 (gpt-oss's experts: QMoE's fp4 has no CPU kernel)
SUPPORTED = FLOAT_TYPES + tuple(BLOCK_TYPES) + DEQUANTIZED_TYPES
MXFP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)  # E2M1 x 2


def unsupported(type_name: str, tensor: str) -> str:
    """The refusal for a type we cannot carry exactly."""
    return (f"tensor {tensor!r} is stored as {type_name}, which cannot be carried exactly; supported GGUF types: "
            f"{', '.join(SUPPORTED)}")


def read_float(type_name: str, data: np.ndarray) -> np.ndarray:
    """An F32 / F16 / BF16 (or MXFP4: `read_mxfp4`) tensor as float32 in memory of its own (copied out of the
    mapping)."""
    if type_name == "F32":
        return np.array(data, dtype=np.float32)
    if type_name == "F16":
        return data.astype(np.float32)
    if type_name == "MXFP4":
        return read_mxfp4(data)
    from gguf.quants import dequantize
    from gguf import GGMLQuantizationType

    return dequantize(np.asarray(data), GGMLQuantizationType.BF16).astype(np.float32, copy=False)


def repack(type_name: str, data: np.ndarray, n: int, k: int) -> tuple[QuantizedArrays, np.ndarray | None]:
    """A block tensor's bytes [N, row bytes] -> (MatMulNBits arrays in its sub-block layout, the per-block
    minimums float32 [N, K / block] or None)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = BLOCK_TYPES[type_name]
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = kind.unpack(np.asarray(data).reshape(-1, type_size))
    subs = k // kind.block
    q = pack(blocks.codes.reshape(n, subs, kind.block), kind.bits)
    zero = None if kind.symmetric else pack(np.zeros((n, subs), np.uint8), kind.bits, pad=2 ** (kind.bits - 1))
    mins = None if blocks.mins is None else blocks.mins.reshape(n, subs)
    return QuantizedArrays(q, blocks.scales.reshape(n, subs).astype(np.float32, copy=False), zero), mins


def read_mxfp4(data: np.ndarray) -> np.ndarray:
    """MXFP4 blocks (1 byte E8M0 exponent e, 16 bytes of two E2M1 codes each, the 16 low nibbles the block's
    first values) -> float32 [..., values]: code's E2M1 value x 2^(e - 127), computed as ggml does (the doubled
    value x 2^(e - 128)): exact, every product fits float32 or overflows alike."""
    raw = np.asarray(data)
    blocks = raw.reshape(-1, 17)
    half = np.ldexp(np.float32(1), blocks[:, :1].astype(np.int32) - 128).astype(np.float32)  # [blocks, 1]
    values = MXFP4_DOUBLED[_nibbles(blocks[:, 1:], 16)] * half                                  # [blocks, 32]
    return values.reshape(*raw.shape[:-1], raw.shape[-1] // 17 * 32)
