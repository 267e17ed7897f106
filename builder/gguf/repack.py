"""GGUF block types -> MatMulNBits arrays, bit-exactly (never dequantized and rounded again).

Every supported block type dequantizes, per sub-block of 16, 32 (or 256) values, as w = s * c (+ m), with c a
small integer code, s a float32 scale and m a float32 minimum (the types with one: Q4_1, Q5_1, Q2_K,
Q4_K, Q5_K). Each sub-block becomes one MatMulNBits block (../shared/ORT_NOTES.md, MatMulNBits):

    type   bits  block  stored code       zero point      minimum
    Q4_0   4     32     q (0..15)         8 (default)     -
    Q4_1   4     32     q (0..15)         8 (default)     m + 8 d             (centred)
    Q5_0   8     32     q + 112           128 (default)   -
    Q5_1   8     32     q + 112 (0..31)   128 (default)   m + 16 d            (centred)
    Q8_0   8     32     q + 128 (int8)    128 (default)   -
    Q2_K   4     16     q + 8 (0..3)      8 (default)     -dmin * m
    Q3_K   4     16     q + 8 (-4..3)     8 (default)     -
    Q4_K   4     32     q (0..15)         8 (default)     -dmin * m + 8 s     (centred)
    Q5_K   8     32     q + 112 (0..31)   128 (default)   -dmin * m + 16 s    (centred)
    Q6_K   8     16     q + 96 (0..63)    128 (default)   -

so (code - zero point) is the type's own integer, less the centre for the centred types, and the scale is the
float32 product the `gguf` package's dequantize computes (d, or d * sub-block scale), in the same order:
(code - zp) * s (+ m) is then its value bit for bit. Centred: s * c + m = s * (c - centre) + (m + centre * s),
the same value wherever m + centre * s is exact in float32 (checked per sub-block; a 4-bit tensor with a block
where it is not keeps uncentred codes with explicit zero points 0 and the plain minimum, an 8-bit block keeps
q + 128 and its minimum). Codes centred on zero halve the error of accuracy level 4's int8 activations on
these types (the offset's share of x @ W moves into the float minimum term; SmolLM2's Q4_1 layers: relative
error 0.41-0.60x of the uncentred form's, issue 47), at the same speed. The minimum is not part of
MatMulNBits: builder/passes/add_block_minimums.py adds its term, (x summed per block) @ M.

The i-quants and the ternary types are not linear in their stored bits, but each value is a small integer
(a table or grid entry, with its sign) times a sub-block scale, so they are 8-bit MatMulNBits too (zero
point 128), at 8 bits a weight plus a float scale per block: more bytes than the file, never rounded again.
The tables and grids are the `gguf` package's own (IQ4_NL.kvalues, each grid class's grid, IQ2_XXS.ksigns):

    type     block  integer (stored code - 128)                   scale
    IQ4_NL   32     kvalues[q] (-127..113)                        d
    IQ4_XS   32     kvalues[q]                                    d * (ls - 32)
    IQ3_XXS  32     +-grid (4..62)                                d * (0.5 + ls) * 0.5
    IQ3_S    32     +-grid (1..15)                                d * (1 + 2 ls)
    IQ2_XXS  32     +-grid (8, 25, 43)                            d * (0.5 + ls) * 0.25
    IQ2_XS   16     +-grid                                        d * (0.5 + ls) * 0.25
    IQ2_S    16     +-grid                                        d * (0.5 + ls) * 0.25
    IQ1_S    32     8 * grid (-1, 0, 1) +- 1                      d * (2 ls + 1) * 0.125
    IQ1_M    16     8 * grid +- 1                                 d * (2 ls + 1) * 0.125
    TQ1_0    256    -1, 0, 1                                      d
    TQ2_0    256    -1, 0, 1                                      d

gguf computes s * g * sign (a sign flip is exact) and, for IQ1_S/IQ1_M, s * (g +- 1/8): that is (s / 8) *
(8 g +- 1) exactly, since a power of two moves no rounding while both stay normal (|s| >= |d|, at least a
float16's smallest subnormal 6e-8, far inside float32's normal range). So no value differs by an ulp
(tests/builder/test_gguf_iquants.py runs every finite float16 d). F32, F16 and BF16 tensors are read as
float32 exactly, MXFP4 (gpt-oss's experts) too (`read_mxfp4`). Any other type (NVFP4, Q8_1, ...) is refused by
name."""
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
    widened: bool = False  # an i-quant or ternary type: carried at 8 bits, more than the file's

    def file_bits(self) -> float:
        """The file's bits per weight, scales included."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        values, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.name]]
        return 8 * size / values
    centre: int = 0  # codes stored this much lower where the minimum absorbs it exactly (see the module's table)


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


def _u32(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view("<u4")


def _u16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view("<u2")


def _grid(type_name: str) -> np.ndarray:
    """gguf's grid of an i-quant type as integers [entries, values per entry] (its float32 grid holds small
    integers: IQ2's 8, 25, 43, IQ3's 1..62, IQ1's -1, 0, 1)."""
    import gguf.quants as quants

    kind = getattr(quants, type_name)
    kind.init_grid()
    return kind.grid.reshape(kind.grid_shape).astype(np.int16)


def _ksigns() -> np.ndarray:
    """IQ2_XXS.ksigns (7 stored sign bits -> 8 with even parity) as sign bits uint8 [128, 8]."""
    from gguf.quants import IQ2_XXS

    return _bits(np.frombuffer(IQ2_XXS.ksigns, np.uint8).reshape(128, 1), 8)


def _signed(grid: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """128 + grid values, negated where the sign bit is set, as uint8 codes [blocks, 256]."""
    n = grid.shape[0]
    return (128 + np.where(signs.reshape(n, -1) != 0, -1, 1) * grid.reshape(n, -1)).astype(np.uint8)


def _fraction(d: np.ndarray, ls: np.ndarray, half: float) -> np.ndarray:
    """gguf's IQ2/IQ3 sub-block scale d * (0.5 + ls) * half, in its float32 order."""
    return d * (np.float32(0.5) + ls.astype(np.float32)) * np.float32(half)


def _iq4_codes(qs: np.ndarray) -> np.ndarray:
    from gguf.quants import IQ4_NL

    return (np.array(IQ4_NL.kvalues, np.int16)[_nibbles(qs, 16)] + 128).astype(np.uint8)


def _iq4_nl(b: np.ndarray) -> Blocks:
    return Blocks(_iq4_codes(b[:, 2:]), _f16(b[:, :2]), None)


def _iq4_xs(b: np.ndarray) -> Blocks:
    d, high, low, qs = _f16(b[:, :2]), _u16(b[:, 2:4]), b[:, 4:8], b[:, 8:]
    ls_high = ((high >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)).astype(np.uint8)
    ls = (_nibbles(low, 1) | (ls_high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return Blocks(_iq4_codes(qs), d * ls.astype(np.float32), None)


def _iq2_xxs(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    d, aux = _f16(b[:, :2]), _u32(b[:, 2:]).reshape(n, 8, 2)
    grid = _grid("IQ2_XXS")[np.ascontiguousarray(aux[..., 0]).view(np.uint8).reshape(n, 32)]  # [n, 32, 8]
    signs = _ksigns()[(aux[..., 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & np.uint32(0x7F)]
    return Blocks(_signed(grid, signs), _fraction(d, aux[..., 1] >> 28, 0.25), None)


def _iq2_xs(b: np.ndarray) -> Blocks:
    d, qs, ls = _f16(b[:, :2]), _u16(b[:, 2:66]), _nibbles(b[:, 66:74], 1)
    grid = _grid("IQ2_XS")[qs & np.uint16(511)]
    return Blocks(_signed(grid, _ksigns()[qs >> 9]), _fraction(d, ls, 0.25), None)


def _iq2_s(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    d, qs, signs, qh, ls = _f16(b[:, :2]), b[:, 2:34], b[:, 34:66], b[:, 66:74], _nibbles(b[:, 74:82], 1)
    high = (qh.reshape(n, 8, 1) >> np.array([0, 2, 4, 6], np.uint8)) & np.uint8(3)
    index = qs.astype(np.uint16) | (high.reshape(n, 32).astype(np.uint16) << 8)
    return Blocks(_signed(_grid("IQ2_S")[index], _bits(signs, QK_K)), _fraction(d, ls, 0.25), None)


def _iq3_xxs(b: np.ndarray) -> Blocks:
    d, qs, aux = _f16(b[:, :2]), b[:, 2:66], _u32(b[:, 66:98])
    signs = _ksigns()[(aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & np.uint32(0x7F)]
    return Blocks(_signed(_grid("IQ3_XXS")[qs], signs), _fraction(d, aux >> 28, 0.5), None)


def _iq3_s(b: np.ndarray) -> Blocks:
    d, qs, qh, signs, ls = _f16(b[:, :2]), b[:, 2:66], b[:, 66:74], b[:, 74:106], _nibbles(b[:, 106:110], 1)
    index = qs.astype(np.uint16) | (_bits(qh, 64).astype(np.uint16) << 8)
    return Blocks(_signed(_grid("IQ3_S")[index], _bits(signs, QK_K)), d * (1 + 2 * ls), None)


def _iq1_codes(grid: np.ndarray, negative_delta: np.ndarray) -> np.ndarray:
    """128 + 8 * grid + 1 (delta +1/8), or - 1 (-1/8), uint8 [blocks, 256]; negative_delta per group of 8."""
    n = grid.shape[0]
    delta = np.where(negative_delta.reshape(n, -1, 1) != 0, -1, 1)
    return (128 + 8 * grid.reshape(n, -1, 8) + delta).astype(np.uint8).reshape(n, QK_K)


def _iq1_s(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    d, qs, qh = _f16(b[:, :2]), b[:, 2:34], _u16(b[:, 34:50])
    dl = d * (2 * ((qh >> 12) & 7) + 1)
    high = (qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)
    index = qs.astype(np.uint16) | (high.reshape(n, 32) << 8)
    negative = np.repeat(qh >> 15, 4, axis=1)  # one delta sign per 32 values
    return Blocks(_iq1_codes(_grid("IQ1_S")[index], negative), dl * np.float32(0.125), None)


def _iq1_m(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    qs, qh, packed = b[:, :32], b[:, 32:48], _u16(b[:, 48:56])
    top = (packed & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], np.uint16)
    d = _f16((top[:, 0] | top[:, 1] | top[:, 2] | top[:, 3]).view(np.uint8).reshape(n, 2))
    ls = ((packed[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)).reshape(n, 16)
    nib = _nibbles(qh, 1)  # per group of 8: 3 high index bits, then the delta's sign
    index = qs.astype(np.uint16) | ((nib & np.uint8(7)).astype(np.uint16) << 8)
    return Blocks(_iq1_codes(_grid("IQ1_M")[index], nib & np.uint8(8)), d * (2 * ls + 1) * np.float32(0.125), None)


def _tq1_0(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    qs, qh, d = b[:, :48], b[:, 48:52], _f16(b[:, 52:54])
    powers = np.array([1, 3, 9, 27, 81], np.uint8).reshape(1, 1, 5, 1)
    trits = [(qs[:, :32].reshape(n, -1, 1, 32) * powers).reshape(n, -1),  # uint8 products wrap, as gguf's
             (qs[:, 32:].reshape(n, -1, 1, 16) * powers).reshape(n, -1),
             (qh.reshape(n, -1, 1, 4) * powers[:, :, :4]).reshape(n, -1)]
    q = (np.concatenate(trits, axis=1).astype(np.uint16) * 3) >> 8  # 0..2
    return Blocks(q.astype(np.uint8) + np.uint8(127), d, None)


def _tq2_0(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    q = (b[:, :64].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    return Blocks(q.reshape(n, QK_K) + np.uint8(127), _f16(b[:, 64:66]), None)


BLOCK_TYPES = {t.name: t for t in (
    BlockType("Q4_0", 4, 32, True, _q4_0), BlockType("Q4_1", 4, 32, False, _q4_1, minimum=True, centre=8),
    BlockType("Q5_0", 8, 32, True, _q5_0), BlockType("Q5_1", 8, 32, True, _q5_1, minimum=True, centre=16),
    BlockType("Q8_0", 8, 32, True, _q8_0),
    BlockType("Q2_K", 4, 16, True, _q2_k, minimum=True), BlockType("Q3_K", 4, 16, True, _q3_k),
    BlockType("Q4_K", 4, 32, False, _q4_k, minimum=True, centre=8),
    BlockType("Q5_K", 8, 32, True, _q5_k, minimum=True, centre=16),
    BlockType("Q6_K", 8, 16, True, _q6_k),
    *(BlockType(name, 8, block, True, unpack, widened=True) for name, block, unpack in (
        ("IQ4_NL", 32, _iq4_nl), ("IQ4_XS", 32, _iq4_xs), ("IQ3_XXS", 32, _iq3_xxs), ("IQ3_S", 32, _iq3_s),
        ("IQ2_XXS", 32, _iq2_xxs), ("IQ2_XS", 16, _iq2_xs), ("IQ2_S", 16, _iq2_s), ("IQ1_S", 32, _iq1_s),
        ("IQ1_M", 16, _iq1_m), ("TQ1_0", 256, _tq1_0), ("TQ2_0", 256, _tq2_0))),
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
    blocks, symmetric = _centred(kind, kind.unpack(np.asarray(data).reshape(-1, type_size)))
    subs = k // kind.block
    q = pack(blocks.codes.reshape(n, subs, kind.block), kind.bits)
    zero = None if symmetric else pack(np.zeros((n, subs), np.uint8), kind.bits, pad=2 ** (kind.bits - 1))
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


def symmetric_layout(type_name: str, data: np.ndarray) -> bool:
    """Whether the tensor's MatMulNBits arrays have default zero points (no `zero_points` input): the type's own
    layout, or for a centred 4-bit type whether every block centres exactly (reads only the blocks' scales)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = BLOCK_TYPES[type_name]
    if not kind.centre or kind.symmetric:
        return kind.symmetric
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    scales, mins = _FOUR_BIT_SCALES[type_name](np.asarray(data).reshape(-1, type_size))
    return bool(_shifted(kind, scales, mins)[1].all())


_FOUR_BIT_SCALES = {"Q4_1": lambda b: (_f16(b[:, :2]), _f16(b[:, 2:4])), "Q4_K": lambda b: _k_scales(b)[:2]}


def _shifted(kind: BlockType, scales: np.ndarray, mins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(m + centre * s in float32, where that is exact) per sub-block; inf / NaN scales are not exact."""
    with np.errstate(invalid="ignore", over="ignore"):
        moved = mins + np.float32(kind.centre) * scales
        exact = moved.astype(np.float64) == mins.astype(np.float64) + kind.centre * scales.astype(np.float64)
    return moved, exact


def _centred(kind: BlockType, blocks: Blocks) -> tuple[Blocks, bool]:
    """(the blocks centred where the shift is exact, whether the layout is symmetric): see the module's table."""
    if not kind.centre:
        return blocks, kind.symmetric
    moved, exact = _shifted(kind, blocks.scales, blocks.mins)
    if not kind.symmetric:  # one zero point for the tensor: 4-bit codes centre only if every block does
        return (Blocks(blocks.codes, blocks.scales, moved), True) if exact.all() else (blocks, False)
    lower = np.repeat(exact, kind.block, axis=1)  # [blocks, values]
    codes = np.where(lower, blocks.codes - np.uint8(kind.centre), blocks.codes)
    return Blocks(codes, blocks.scales, np.where(exact, moved, blocks.mins)), True
