"""What the pre-quantized formats share: int32 words holding 32/bits little-endian codes, and the
conversion of codes, scales and zero points per group into MatMulNBits' blocks."""
from __future__ import annotations

import numpy as np

from typing import Callable

from builder.quant.schemes import MATMUL_NBITS_BLOCKS, QuantizedArrays, pack
from builder.weights import CheckpointError
from runtime.manifest.arith import ceil_div


def unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint8 codes from int32 words along `axis`: word w holds codes 32/bits*w + j at bits [bits*j, ...).
    Through the words' little-endian bytes: 8-bit codes are the bytes, 4-bit ones their low then high
    nibbles (one byte per code of temporaries, not eight)."""
    data = np.ascontiguousarray(np.moveaxis(np.asarray(words), axis, -1)).astype("<i4", copy=False)
    raw = data.view(np.uint8)  # [..., words * 4]
    codes = raw if bits == 8 else np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(raw.shape[:-1] + (-1,))
    return np.moveaxis(codes, -1, axis)


def expect_shape(name: str, array: np.ndarray, shape: tuple[int, ...], what: str) -> None:
    """A wrongly packed or truncated tensor is refused with its name."""
    if tuple(array.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r}: shape {list(array.shape)}, expected {list(shape)} ({what}); "
                              f"the checkpoint is truncated or not written in this layout")


def read_qweight(read: Callable[[str], np.ndarray], module: str, layout: str) -> np.ndarray:
    """`<m>.qweight` of a GPTQ or AWQ module: int32 [rows, cols] packed as `layout` says, else refused by name."""
    qweight = read(f"{module}.qweight")
    if qweight.dtype != np.int32 or qweight.ndim != 2:
        raise CheckpointError(f"tensor '{module}.qweight': {qweight.dtype}{list(qweight.shape)}, expected int32 "
                              f"{layout}")
    return qweight


def read_groups(read: Callable[[str], np.ndarray], module: str, n: int, k: int, group: int,
                bits: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(group, scales [groups, N], qzeros int32 [groups, N*bits/32]) of a GPTQ or AWQ module, their shapes
    checked; `group` -1 is one group over the whole of K."""
    group = k if group == -1 else group
    groups = ceil_div(k, group)
    scales = read(f"{module}.scales")
    expect_shape(f"{module}.scales", scales, (groups, n), f"one row per group of {group} of K={k}")
    qzeros = read(f"{module}.qzeros")
    expect_shape(f"{module}.qzeros", qzeros, (groups, n * bits // 32), f"{32 // bits} zero points per int32 along N={n}")
    return group, scales, qzeros


def block_for(group: int, k: int) -> int:
    """The MatMulNBits block for groups of `group` columns: the largest allowed block dividing the group,
    so that each block lies inside one group; 128 when one group spans the whole row (per channel)."""
    if group >= k:
        return 128
    fits = [b for b in MATMUL_NBITS_BLOCKS if group % b == 0]
    if not fits:
        raise CheckpointError(f"group size {group}: no MatMulNBits block {list(MATMUL_NBITS_BLOCKS)} divides it")
    return max(fits)


def to_matmul_nbits(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int,
                    group: int, symmetric: bool, name: str) -> tuple[QuantizedArrays, int]:
    """codes uint8 [N, K], scales float [N, groups], zeros uint8 [N, groups] (None: 2^(bits-1)) with
    group g covering columns [g*group, (g+1)*group) -> (MatMulNBits arrays, block). Exact: each block
    lies in one group and takes its scale and zero point. `symmetric` (the checkpoint's config) leaves
    the zero points out; the stored ones, `name`, must then all be 2^(bits-1)."""
    n, k = codes.shape
    block = block_for(group, k)
    blocks = ceil_div(k, block)
    owner = np.minimum(np.arange(blocks) * block // group, scales.shape[1] - 1)  # the group of each block
    padded = np.zeros((n, blocks * block), np.uint8)
    padded[:, :k] = codes
    mid = 2 ** (bits - 1)
    if symmetric and zeros is not None and np.any(zeros != mid):
        raise CheckpointError(f"tensor {name!r}: zero points other than {mid} in a checkpoint its config calls "
                              f"symmetric")
    zp = None if symmetric or zeros is None else pack(zeros[:, owner].astype(np.uint8), bits, pad=mid)
    q = pack(padded.reshape(n, blocks, block), bits)
    return QuantizedArrays(q, scales[:, owner].astype(np.float32), zp), block
