"""AWQ as AutoAWQ writes its GEMM layout (`version: gemm`), per linear module `<m>`, 4 bits:

    <m>.qweight  int32 [K, N/8]        8 codes per int32 along N, interleaved: nibble i of word j
                                       holds column 8j + ORDER[i], ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    <m>.qzeros   int32 [K/group, N/8]  zero points, packed the same way
    <m>.scales   float16 [K/group, N]
    W[n, k] = scales[k // group, n] * (code[k, n] - zero[k // group, n])"""
from __future__ import annotations

from typing import Callable

import numpy as np

from builder.quant.formats.packing import read_groups, read_qweight, to_matmul_nbits, unpack_words
from builder.quant.schemes import QuantizedArrays

ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
UNDO = np.argsort(ORDER)  # nibble that holds column c of a word


def read_awq(read: Callable[[str], np.ndarray], module: str, group: int, symmetric: bool) -> tuple[QuantizedArrays, int, int, int]:
    """(arrays, block, N, K) of one AutoAWQ GEMM module."""
    qweight = read_qweight(read, module, "[K, N/8] (AWQ GEMM packs 8 codes per int32 along N)")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group, scales, qzeros = read_groups(read, module, n, k, group, 4)
    codes, zeros = _deinterleave(unpack_words(qweight, 4, axis=1)), _deinterleave(unpack_words(qzeros, 4, axis=1))
    arrays, block = to_matmul_nbits(codes.T, scales.T, zeros.T, 4, group, symmetric, f"{module}.qzeros")
    return arrays, block, n, k


def _deinterleave(values: np.ndarray) -> np.ndarray:
    """[rows, N] in AutoAWQ's nibble order -> columns in order."""
    rows, n = values.shape
    return values.reshape(rows, n // 8, 8)[:, :, UNDO].reshape(rows, n)
