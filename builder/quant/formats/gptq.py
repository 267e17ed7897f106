"""GPTQ as gptqmodel and auto-gptq write it, per linear module `<m>`:

    <m>.qweight  int32 [K*bits/32, N]      codes packed along K, code 32/bits*r + j at bits [bits*j, ...) of row r
    <m>.qzeros   int32 [groups, N*bits/32] zero points packed along N the same way
    <m>.scales   float16 [groups, N]
    <m>.g_idx    int32 [K]                 the group of each input column (optional)
    W[n, k] = scales[g, n] * (code[k, n] - zero[g, n]),  g = g_idx[k]

In the original (v1, `checkpoint_format: gptq`) layout the stored zero point is the real one minus 1
(a symmetric 4-bit checkpoint stores 7 for 8); gptq_v2 stores it as is. With desc_act (act-order) GPTQ
quantizes the columns in its own order and g_idx is that order's grouping: column k belongs to group
g_idx[k], and each group still holds exactly group_size columns. The reader sorts the K columns by
g_idx (`column_order`) so that every group is contiguous, as MatMulNBits' blocks are; the engine then
feeds the activation in that order (builder/passes/permute_activations.py). A g_idx that does not put
group_size columns in each group is refused by name."""
from __future__ import annotations

from typing import Callable

import numpy as np

from builder.quant.formats.packing import expect_shape, read_groups, read_qweight, to_matmul_nbits, unpack_words
from builder.quant.schemes import QuantizedArrays
from builder.weights import CheckpointError
from runtime.manifest.arith import ceil_div


def read_gptq(read: Callable[[str], np.ndarray], module: str, bits: int, group: int, symmetric: bool,
              v2: bool) -> tuple[QuantizedArrays, int, int, int]:
    """(arrays, block, N, K) of one GPTQ module; `group` -1 is one group per output channel."""
    qweight = read_qweight(read, module, f"[K*{bits}/32, N] (GPTQ packs {32 // bits} codes per int32 along K)")
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    group, scales, qzeros = read_groups(read, module, n, k, group, bits)
    zeros = unpack_words(qzeros, bits, axis=1).astype(np.int32)  # [groups, N]
    if not v2:
        zeros = zeros + 1
        if zeros.max() > 2**bits - 1:
            raise CheckpointError(f"tensor '{module}.qzeros': a v1 zero point of {2**bits} (stored {2**bits - 1}), which "
                                  f"MatMulNBits' {bits}-bit zero points cannot hold")
    codes = unpack_words(qweight, bits, axis=0).T  # [N, K]
    order = column_order(read, module, k, group)
    if order is not None:
        codes = codes[:, order]  # [N, K] with each group's columns together
    arrays, block = to_matmul_nbits(codes, scales.T, zeros.T.astype(np.uint8), bits, group, symmetric,
                                    f"{module}.qzeros")
    return arrays, block, n, k


def column_order(read, module: str, k: int, group: int) -> np.ndarray | None:
    """The order that makes each group's columns contiguous: int64 [K], stored column j is weight column
    order[j]; None when g_idx is absent or already k // group_size."""
    try:
        g_idx = read(f"{module}.g_idx")
    except (KeyError, CheckpointError):
        return None
    expect_shape(f"{module}.g_idx", g_idx, (k,), "one group index per input column")
    group = k if group == -1 else group
    groups = ceil_div(k, group)
    sizes = np.bincount(np.clip(g_idx, 0, groups), minlength=groups + 1)
    expected = np.minimum(group, k - np.arange(groups) * group)
    if g_idx.min() < 0 or sizes[groups] or not np.array_equal(sizes[:groups], expected):
        raise CheckpointError(f"tensor '{module}.g_idx': not a grouping of K={k} columns into {groups} groups of "
                              f"{group} (group sizes {sizes[:groups].tolist()[:8]}..., values {int(g_idx.min())}.."
                              f"{int(g_idx.max())}); supported: each group index 0..{groups - 1} on exactly {group} "
                              f"columns, as GPTQ (desc_act or not) writes it")
    order = np.argsort(g_idx, kind="stable")
    return None if np.array_equal(order, np.arange(k)) else order
