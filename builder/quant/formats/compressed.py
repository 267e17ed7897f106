"""compressed-tensors `pack-quantized` as llm-compressor writes it (W4A16 / W8A16), per module `<m>`:

    <m>.weight_packed      int32 [N, ceil(K*bits/32)]  codes + 2^(bits-1) packed along K, code i at bit bits*i
    <m>.weight_scale       float [N, groups]           groups = 1 for the channel strategy
    <m>.weight_zero_point  int32 [ceil(N*bits/32), groups]  asymmetric only: zero + 2^(bits-1) packed along N
    <m>.weight_shape       int [2]                     (N, K)
    W[n, k] = scale[n, g] * (q[n, k] - zero[n, g]),  q and zero signed

The stored (offset) codes and zero points are MatMulNBits' unsigned ones as they are."""
from __future__ import annotations

from typing import Callable

import numpy as np

from builder.quant.formats.packing import expect_shape, to_matmul_nbits, unpack_words
from builder.quant.schemes import QuantizedArrays
from builder.weights import CheckpointError
from runtime.manifest.arith import ceil_div


def read_compressed(read: Callable[[str], np.ndarray], module: str, bits: int, group: int,
                    symmetric: bool) -> tuple[QuantizedArrays, int, int, int]:
    """(arrays, block, N, K) of one pack-quantized module; `group` -1 is the channel strategy."""
    shape = read(f"{module}.weight_shape").reshape(-1)
    if shape.size != 2 or np.any(shape <= 0):
        raise CheckpointError(f"tensor '{module}.weight_shape': {shape.tolist()}, expected [N, K]")
    n, k = int(shape[0]), int(shape[1])
    packed = read(f"{module}.weight_packed")
    expect_shape(f"{module}.weight_packed", packed, (n, ceil_div(k * bits, 32)), f"{32 // bits} codes per int32 along K={k}")
    group = k if group == -1 else group
    groups = ceil_div(k, group)
    scales = read(f"{module}.weight_scale")
    expect_shape(f"{module}.weight_scale", scales, (n, groups), f"one column per group of {group} of K={k}")
    zeros = None
    if not symmetric:
        stored = read(f"{module}.weight_zero_point")
        expect_shape(f"{module}.weight_zero_point", stored, (ceil_div(n * bits, 32), groups),
                     f"{32 // bits} zero points per int32 along N={n}")
        zeros = unpack_words(stored, bits, axis=0)[:n]
    if packed.dtype != np.int32:
        raise CheckpointError(f"tensor '{module}.weight_packed': {packed.dtype}, expected int32")
    codes = unpack_words(packed, bits, axis=1)[:, :k]
    arrays, block = to_matmul_nbits(codes, scales, zeros, bits, group, symmetric, f"{module}.weight_zero_point")
    return arrays, block, n, k
