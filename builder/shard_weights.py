"""Lazy slices of weights for tensor-parallel shards.

A `Slice` keeps some index ranges of a lazy weight along one axis. When it is materialized it reads
only those ranges: from a checkpoint tensor through safetensors' `get_slice` (the rest of the tensor is
never read), and through a `Concat` on the same axis by slicing each part. So writing one rank's
engine streams that rank's share of each tensor, never the whole model."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from builder.weights import CheckpointTensor, Concat, WeightSource


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

