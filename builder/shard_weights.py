"""Lazy slices of weights for tensor-parallel shards.

A `Slice` keeps some index ranges of a lazy weight along one axis. When it is materialized it reads
only those ranges: from a checkpoint tensor through safetensors' `get_slice` (the rest of the tensor is
never read), and through a `Concat` on the same axis by slicing each part. So writing one rank's
engine streams that rank's share of each tensor, never the whole model.

`shard` is what the tensor-parallel pass asks for: a pre-quantized weight (a GGUF block tensor, an imported
GPTQ / AWQ one; or row-wise fused ones) stays pre-quantized, its MatMulNBits arrays (and GGUF block
minimums) sliced by rows, or by whole blocks of columns, so each rank keeps the file's own integers."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from builder.quant.schemes import QuantizedArrays, pack, unpack
from builder.quant.weights import Prequantized
from builder.weights import CheckpointTensor, Concat, WeightSource
from runtime.manifest.arith import ceil_div


def shard(source: WeightSource, axis: int, ranges: list[tuple[int, int]]) -> WeightSource:
    """`source` restricted to the half-open `ranges` along `axis`: pre-quantized arrays sliced where `source`
    is pre-quantized (`sliced_prequantized`), else a lazy `Slice`."""
    if axis == 0 or len(ranges) == 1:
        pieces = [sliced_prequantized(source, axis, lo, hi) for lo, hi in ranges]
        if all(p is not None for p in pieces):
            return pieces[0] if len(pieces) == 1 else Concat(pieces, axis)
    return Slice(source, axis, ranges)


def sliced_prequantized(source: WeightSource, axis: int, lo: int, hi: int) -> WeightSource | None:
    """Rows (axis 0) or columns (axis 1) [lo, hi) of a Prequantized weight, or of row-wise concatenated ones,
    as Prequantized weights holding the same integers; None when `source` is not pre-quantized. Columns are
    split between blocks only: a split inside a block is refused (its scale and minimum span both ranks)."""
    if isinstance(source, Concat) and source.axis == 0:
        if axis == 1:
            parts = [sliced_prequantized(p, 1, lo, hi) for p in source.parts]
        else:
            parts, start = [], 0
            for part in source.parts:
                a, b = max(lo, start), min(hi, start + part.shape[0])
                if a < b:
                    parts.append(sliced_prequantized(part, 0, a - start, b - start))
                start += part.shape[0]
        if any(p is None for p in parts):
            return None
        return parts[0] if len(parts) == 1 else Concat(parts, 0)
    if not isinstance(source, Prequantized) or source.order is not None:
        return None
    if axis == 0:
        rows = slice(lo, hi)
        return _with_arrays(source, lambda a: a[rows], hi - lo, source.k)
    block = source.block
    if lo % block or hi % block:
        raise ValueError(f"{source.key or 'a weight'} ({source.label}, {source.bits}-bit blocks): tensor parallelism would split its columns at [{lo}, {hi}), inside its "
                         f"blocks of {block} (one scale{' and minimum' if _minimums(source) else ''} per block "
                         f"spans both ranks, so no rank's share is exact); supported: splits at multiples of "
                         f"{block}: build with a tensor_parallel whose share of the split dimension divides by {block}")
    blocks = slice(lo // block, hi // block)
    return _with_arrays(source, lambda a: a[:, blocks], source.n, hi - lo)


def _minimums(source: Prequantized):
    return getattr(source, "minimums", None)


def _with_arrays(source: Prequantized, take, n: int, k: int) -> Prequantized:
    """`source` with `take` applied to each of its arrays (and block minimums), shaped [n, k]."""
    bits, count = source.bits, ceil_div(source.k, source.block)

    def load() -> QuantizedArrays:
        q, scales, zp = source.load()
        zp = None if zp is None else pack(take(unpack(zp, bits, count)), bits, pad=1 << (bits - 1))
        return QuantizedArrays(take(q), take(scales), zp)

    extra = {"minimums": (lambda: take(_minimums(source)()))} if _minimums(source) else {}
    return dataclasses.replace(source, load=load, n=n, k=k, **extra)


@dataclass(eq=False)
class Slice(WeightSource):
    """`source` restricted to the half-open `ranges` along `axis`, joined in order."""

    source: WeightSource
    axis: int
    ranges: list[tuple[int, int]]

    def __post_init__(self) -> None:
        size = self.source.shape[self.axis]
        for lo, hi in self.ranges:
            if not 0 <= lo < hi <= size:
                raise ValueError(f"slice [{lo}, {hi}) is outside axis {self.axis} of size {size} of {self.source}")
        self.dtype = self.source.dtype
        shape = list(self.source.shape)
        shape[self.axis] = sum(hi - lo for lo, hi in self.ranges)
        self.shape = tuple(shape)

    def materialize(self) -> np.ndarray:
        return np.concatenate([_read(self.source, self.axis, lo, hi) for lo, hi in self.ranges], axis=self.axis)

    def __str__(self) -> str:
        spans = ", ".join(f"{lo}:{hi}" for lo, hi in self.ranges)
        return f"slice({self.source}, axis={self.axis}, [{spans}])"


def _read(source: WeightSource, axis: int, lo: int, hi: int) -> np.ndarray:
    """Rows (or columns) [lo, hi) of `source` along `axis`, reading no more of it than needed."""
    if isinstance(source, Concat) and source.axis == axis:
        parts, start = [], 0
        for part in source.parts:
            size = part.shape[axis]
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                parts.append(_read(part, axis, a - start, b - start))
            start += size
        return np.concatenate(parts, axis=axis)
    if isinstance(source, Slice) and source.axis == axis:
        return source.materialize().take(np.arange(lo, hi), axis=axis)
    if isinstance(source, CheckpointTensor):
        return source.checkpoint.read_slice(source.key, axis, lo, hi)
    return np.ascontiguousarray(source.materialize().take(np.arange(lo, hi), axis=axis))

