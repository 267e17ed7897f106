"""Centred codes for the GGUF types with a block minimum (builder/gguf/repack.py): s*c + m stored as
s*(c - centre) + (m + centre*s), bit for bit the file's value, wherever m + centre*s is exact in float32; a block
where it is not keeps its own codes and minimum (8 bits) or keeps the whole 4-bit tensor uncentred."""
from __future__ import annotations

import numpy as np
import pytest

from builder.gguf.repack import BLOCK_TYPES, repack, symmetric_layout
from builder.quant.schemes import dequantize, unpack
from tests.builder.gguf_files import SCALE_FIELDS, random_blocks

pytest.importorskip("gguf")
CENTRED = [name for name, kind in BLOCK_TYPES.items() if kind.centre]


def _oracle(raw: np.ndarray, type_name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(raw, GGMLQuantizationType[type_name])


def _value(type_name: str, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, object]:
    """(our dequantized value, the codes less their zero point, the arrays) of a repacked tensor."""
    kind = BLOCK_TYPES[type_name]
    arrays, mins = repack(type_name, raw, n, k)
    value = dequantize(arrays, kind.bits, kind.block, k) + np.repeat(mins, kind.block, axis=1)
    zero = 0 if arrays.zero_points is not None else 2 ** (kind.bits - 1)
    codes = unpack(arrays.q, kind.bits, kind.block).astype(np.int32) - zero
    return value, codes, arrays


def test_the_centred_types_are_the_ones_with_a_minimum():
    assert sorted(CENTRED) == ["Q4_1", "Q4_K", "Q5_1", "Q5_K"]


@pytest.mark.parametrize("type_name", CENTRED)
def test_centred_codes_keep_the_files_values_bit_for_bit(type_name):
    rng = np.random.default_rng(3)
    raw = random_blocks(type_name, 8, 512, rng)
    value, codes, arrays = _value(type_name, raw, 8, 512)
    kind = BLOCK_TYPES[type_name]
    assert arrays.zero_points is None and symmetric_layout(type_name, raw)
    half = kind.centre
    assert codes.min() >= -half and codes.max() < half  # centred on zero: 4-bit -8..7, 5-bit -16..15
    expected = _oracle(raw, type_name)
    np.testing.assert_array_equal(value.view(np.uint32), expected.view(np.uint32))


def _inexact(type_name: str, raw: np.ndarray) -> np.ndarray:
    """raw with block 0's minimum made tiny beside its scale, so that m + centre*s is not exact in float32."""
    raw = raw.copy()
    d_at, m_at = SCALE_FIELDS[type_name]
    raw[0, d_at:d_at + 2] = np.array([1.0], np.float16).view(np.uint8)
    raw[0, m_at:m_at + 2] = np.array([2.0 ** -24], np.float16).view(np.uint8)  # a float16 subnormal
    if type_name.endswith("_K"):
        raw[0, 4:16] = 0x3F  # every sub-block's 6-bit scale and min 63 (m large, so 63*dmin + 8*63*d is wide)
    return raw


@pytest.mark.parametrize("type_name", CENTRED)
def test_a_block_that_cannot_centre_exactly_stays_as_the_file_has_it(type_name):
    rng = np.random.default_rng(4)
    raw = _inexact(type_name, random_blocks(type_name, 4, 256, rng))
    value, codes, arrays = _value(type_name, raw, 4, 256)
    kind = BLOCK_TYPES[type_name]
    expected = _oracle(raw, type_name)
    np.testing.assert_array_equal(value.view(np.uint32), expected.view(np.uint32))
    if kind.bits == 4:  # one zero point for the tensor: uncentred, explicit zero points 0
        assert arrays.zero_points is not None and not symmetric_layout(type_name, raw) and codes.min() >= 0
    else:  # that block alone keeps q + 128 (codes 0..31); the others are centred
        values = 256 if type_name.endswith("_K") else 32  # the first block of the file's bytes
        first = codes.reshape(4, -1)[0, :values]
        assert arrays.zero_points is None and first.min() >= 0 and codes[1:].min() < 0
