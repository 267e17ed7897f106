"""Lazy weight sources for quantization, in the style of builder/weights.py.

`QuantizedWeight` is one part (q, scales or zero_points) of a quantized source weight. The three parts
of one weight share a `Quantizer`, which quantizes the source once, hands each part out, and forgets
the result when every part has been taken: the engine writer materializes a weight's parts one after
the other, so the peak stays about one float weight (two while a fused or scaled weight is assembled)
plus its quantized copy (1/8 of it for int4, 1/4 for int8) and the temporaries of 1024 rows.

A `Quantizer` with a `run_block` smaller than its block hands out the same weight re-blocked (`reblock`): codes
as they are, each block's scale and zero point written once per smaller block, so MatMulNBits computes with the
same values while its int8 activations (accuracy level 4) round per `run_block` values (issue 47).

`ScaledWeight` multiplies a slice of a source along one axis by a vector (AWQ scale folding), `ClippedWeight`
clamps each block of a row to a bound (AWQ's clipping).
`Prequantized` is a weight whose MatMulNBits arrays already exist (GPTQ's solution, an imported
checkpoint's integers): the Quantizer hands them out as they are, never rounding its float value again.
One whose columns are stored permuted (a GPTQ desc_act checkpoint, `order`) is used through
`PermutedColumns`, the weight in stored column order, which reads an activation permuted the same way
(builder/passes/permute_activations.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from builder.quant.schemes import QuantizedArrays, dequantize, pack, quantize, unpack
from builder.weights import Concat, WeightSource
from runtime.manifest.arith import ceil_div

PARTS = ("q", "scales", "zero_points")
ROWS_PER_CHUNK = 1024


@dataclass(eq=False)
class PartsOnce:
    """Makes a quantized weight's parts together on first request and forgets them once each part was taken
    (the engine writer takes a weight's parts one after the other). Subclasses say which parts, their
    shapes, a label and how to make them."""

    _result: dict[str, np.ndarray] | None = field(default=None, init=False, repr=False)
    _pending: set[str] = field(default_factory=set, init=False, repr=False)

    def parts(self) -> tuple[str, ...]:
        raise NotImplementedError

    def shape(self, part: str) -> tuple[int, ...]:
        raise NotImplementedError

    def label(self) -> str:
        raise NotImplementedError

    def make(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def take(self, part: str) -> np.ndarray:
        if self._result is None:
            self._result, self._pending = self.make(), set(self.parts())
        array = self._result[part]
        self._pending.discard(part)
        if not self._pending:
            self._result = None
        return array


@dataclass(eq=False)
class Quantizer(PartsOnce):
    """Quantizes `source` [N, K] on first request in blocks of `block`; keeps the result until each part was
    taken once. `run_block` (a divisor of `block`): the parts handed out re-blocked to it, exactly (`reblock`)."""

    source: WeightSource
    bits: int
    block: int
    symmetric: bool
    run_block: int | None = None

    def __post_init__(self) -> None:
        self.run_block = self.run_block or self.block
        check_reblock(self.bits, self.block, self.run_block)

    def parts(self) -> tuple[str, ...]:
        return PARTS if not self.symmetric else PARTS[:2]

    def shape(self, part: str) -> tuple[int, ...]:
        n, k = self.source.shape
        blocks = ceil_div(k, self.run_block)
        return {"q": (n, blocks, self.run_block * self.bits // 8), "scales": (n, blocks),
                "zero_points": (n, ceil_div(blocks * self.bits, 8))}[part]

    def label(self) -> str:
        run = f"_run{self.run_block}" if self.run_block != self.block else ""
        return f"quant{self.bits}_{'sym' if self.symmetric else 'zp'}_b{self.block}{run}"

    def arrays(self) -> QuantizedArrays:
        """The source's MatMulNBits arrays: as given for a (concatenation of) Prequantized weight(s) in
        this layout, else round-to-nearest of its float value."""
        exact = exact_arrays(self.source, self.bits, self.block, self.symmetric)
        return exact if exact is not None else self._quantize(self.source.materialize())

    def make(self) -> dict[str, np.ndarray]:
        arrays = reblock(self.arrays(), self.bits, self.block, self.run_block, self.source.shape[1])
        return {part: getattr(arrays, part) for part in self.parts()}

    def _quantize(self, w: np.ndarray) -> QuantizedArrays:
        """In chunks of rows, so the float temporaries stay small next to the weight itself."""
        chunks = [quantize(w[i:i + ROWS_PER_CHUNK], self.bits, self.block, self.symmetric)
                  for i in range(0, len(w), ROWS_PER_CHUNK)]
        return QuantizedArrays(*(None if parts[0] is None else np.concatenate(parts) for parts in zip(*chunks)))


@dataclass(eq=False)
class QuantizedWeight(WeightSource):
    """One part of a quantized weight ("q", "scales" or "zero_points"): in MatMulNBits layout from a
    `Quantizer` (see builder/quant/schemes.py), or of stacked experts from an `ExpertQuantizer`
    (builder/quant/experts.py)."""

    quantizer: PartsOnce
    part: str

    def __post_init__(self) -> None:
        if self.part not in self.quantizer.parts():
            raise ValueError(f"part {self.part!r} is not one of {self.quantizer.parts()}")
        self.shape = self.quantizer.shape(self.part)
        self.dtype = "float32" if self.part == "scales" else "uint8"

    def materialize(self) -> np.ndarray:
        return self.quantizer.take(self.part)

    def __str__(self) -> str:
        return f"{self.quantizer.label()}.{self.part}({self.quantizer.source})"


def quantized_parts(source: WeightSource, bits: int, block: int, symmetric: bool,
                    run_block: int | None = None) -> dict[str, QuantizedWeight]:
    """The lazy parts of one quantized weight, sharing one Quantizer: {"q", "scales"[, "zero_points"]}; in blocks
    of `run_block` (re-blocked exactly) where given."""
    quantizer = Quantizer(source, bits, block, symmetric, run_block)
    return {part: QuantizedWeight(quantizer, part) for part in quantizer.parts()}


def check_reblock(bits: int, block: int, run_block: int) -> None:
    """A re-block is exact only into blocks that divide the stored ones and start on a byte."""
    if block % run_block or run_block * bits % 8:
        raise ValueError(f"{bits}-bit blocks of {block} cannot be re-blocked exactly to {run_block}: the new block "
                         f"must divide the stored one and hold whole bytes")


def reblock(arrays: QuantizedArrays, bits: int, block: int, run_block: int, k: int) -> QuantizedArrays:
    """The MatMulNBits arrays of the same weight in blocks of `run_block` (dividing `block`): q's bytes as they are
    (a block's values are stored in order along K, so its bytes are its smaller blocks' one after the other), each
    scale and zero point repeated once per smaller block; blocks past K (a padded last block) dropped. The
    dequantized weight is the same bit for bit."""
    check_reblock(bits, block, run_block)
    if run_block == block:
        return arrays
    q, scales, zero_points = arrays
    n, blocks = scales.shape
    ratio, kept = block // run_block, ceil_div(k, run_block)
    q = q.reshape(n, blocks * ratio, run_block * bits // 8)[:, :kept]
    scales = np.repeat(scales, ratio, axis=1)[:, :kept]
    if zero_points is not None:
        zero = np.repeat(unpack(zero_points, bits, blocks), ratio, axis=1)[:, :kept]
        zero_points = pack(zero, bits, pad=2 ** (bits - 1))
    return QuantizedArrays(np.ascontiguousarray(q), np.ascontiguousarray(scales), zero_points)


@dataclass(eq=False)
class Prequantized(WeightSource):
    """A float weight [N, K] given by its MatMulNBits arrays, which `load()` returns (read from a
    pre-quantized checkpoint on demand, or held after GPTQ); materialize() dequantizes them. `order`
    int64 [K]: the arrays' column j is the weight's column order[j] (None: in order)."""

    load: Callable[[], QuantizedArrays]
    bits: int
    block: int
    n: int
    k: int
    symmetric: bool
    key: str | None = None  # the checkpoint tensor it stands for
    label: str = "prequantized"
    order: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.shape, self.dtype = (self.n, self.k), "float32"

    def materialize(self) -> np.ndarray:
        stored = dequantize(self.load(), self.bits, self.block, self.k)
        return stored if self.order is None else unpermute_columns(stored, self.order)

    def __str__(self) -> str:
        name = f"{self.label}{self.bits}_{'sym' if self.symmetric else 'zp'}_b{self.block}"
        return f'{name}["{self.key}"]' if self.key else name


@dataclass(eq=False)
class PermutedColumns(WeightSource):
    """`source`'s columns taken in `order` (int64 [K]): W[:, order], for x[..., order] @ W[:, order].T."""

    source: WeightSource
    order: np.ndarray

    def __post_init__(self) -> None:
        self.shape, self.dtype = tuple(self.source.shape), self.source.dtype

    def materialize(self) -> np.ndarray:
        return self.source.materialize()[:, self.order]

    def __str__(self) -> str:
        return f"permuted_columns({self.source})"


def unpermute_columns(value: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The inverse of value[:, order]."""
    out = np.empty_like(value)
    out[:, order] = value
    return out


def _stored(source: WeightSource) -> Prequantized | None:
    """The Prequantized whose arrays are `source` exactly as stored, or None. One stored permuted is
    only usable through PermutedColumns in its own order."""
    if isinstance(source, PermutedColumns) and isinstance(source.source, Prequantized):
        inner = source.source
        return inner if inner.order is not None and np.array_equal(inner.order, source.order) else None
    if isinstance(source, Prequantized) and source.order is not None:
        raise ValueError(f"{source}: its columns are stored permuted (GPTQ desc_act); it is read only through "
                         f"PermutedColumns after permute_activations permuted its input")
    return source if isinstance(source, Prequantized) else None


def prequantized_layout(source: WeightSource) -> tuple[int, int, bool] | None:
    """(bits, block, symmetric) of a Prequantized source or of row-wise concatenated ones that agree."""
    stored = _stored(source)
    if stored is not None:
        return stored.bits, stored.block, stored.symmetric
    if isinstance(source, Concat) and source.axis == 0:
        layouts = {prequantized_layout(p) for p in source.parts}
        return layouts.pop() if len(layouts) == 1 and None not in layouts else None
    return None


def block_minimums(source: WeightSource, block: int) -> np.ndarray | None:
    """The per-block minimums [N, K / block] of a pre-quantized weight whose blocks carry one (w = s*c + m: a
    GGUF Q4_1 / Q5_1 / Q2_K / Q4_K / Q5_K tensor, whose `minimums()` gives them), or of row-wise concatenated
    ones (zeros for a part without); None when no part has any."""
    if callable(getattr(source, "minimums", None)):
        return source.minimums() if source.block == block else None
    parts = getattr(source, "parts", None)
    if parts is None or getattr(source, "axis", None) != 0:
        return None
    found = [block_minimums(p, block) for p in parts]
    if all(m is None for m in found):
        return None
    return np.concatenate([np.zeros((p.shape[0], p.shape[1] // block), np.float32) if m is None else m
                           for p, m in zip(parts, found)])


def has_minimums(source: WeightSource) -> bool:
    """Whether `source` (or a row-wise part of it) carries block minimums (see block_minimums)."""
    return callable(getattr(source, "minimums", None)) or any(has_minimums(p) for p in getattr(source, "parts", []))


def reference_holds(source: WeightSource) -> bool:
    """Whether the transformers reference loads exactly this value itself (a GGUF tensor, `reference_loads`:
    transformers reads the same file), or row-wise concatenated such values, so verification need not copy it."""
    if getattr(source, "reference_loads", False):
        return True
    parts = getattr(source, "parts", None)
    return bool(parts) and getattr(source, "axis", None) == 0 and all(reference_holds(p) for p in parts)


def same_storage(sources: list[WeightSource]) -> bool:
    """Whether weights can be fused by rows without losing a stored layout: all float, or all pre-quantized
    in one (bits, block, symmetric) layout (a GGUF file mixes types: Q4_K q/k beside a Q6_K v)."""
    return len({prequantized_layout(s) for s in sources}) == 1


def exact_arrays(source: WeightSource, bits: int, block: int, symmetric: bool) -> QuantizedArrays | None:
    """The arrays of a Prequantized source (or of row-wise concatenated ones) in exactly this layout;
    None when `source` is anything else."""
    stored = _stored(source)
    if stored is not None:
        same = (stored.bits, stored.block, stored.symmetric) == (bits, block, symmetric)
        return stored.load() if same else None
    if isinstance(source, Concat) and source.axis == 0:
        parts = [exact_arrays(p, bits, block, symmetric) for p in source.parts]
        if any(p is None for p in parts):
            return None
        return QuantizedArrays(*(None if a[0] is None else np.concatenate(a) for a in zip(*parts)))
    return None


@dataclass(eq=False)
class ScaledWeight(WeightSource):
    """`source` with the slice [start, start + len(scale)) along `axis` multiplied by `scale`."""

    source: WeightSource
    scale: np.ndarray
    axis: int = 0
    start: int = 0
    label: str = "awq"

    def __post_init__(self) -> None:
        self.shape, self.dtype = tuple(self.source.shape), self.source.dtype
        if self.start + len(self.scale) > self.shape[self.axis]:
            raise ValueError(f"scale of {len(self.scale)} from {self.start} exceeds axis {self.axis} of {self.shape}")

    def materialize(self) -> np.ndarray:
        array = np.array(self.source.materialize(), dtype=np.float32)  # a copy: sources may share arrays
        index = [slice(None)] * array.ndim
        index[self.axis] = slice(self.start, self.start + len(self.scale))
        shape = [1] * array.ndim
        shape[self.axis] = len(self.scale)
        array[tuple(index)] *= self.scale.astype(np.float32).reshape(shape)
        return array

    def __str__(self) -> str:
        stop = self.start + len(self.scale)
        return f"scaled({self.source}, {self.label}[{self.start}:{stop}], axis={self.axis})"


@dataclass(eq=False)
class ClippedWeight(WeightSource):
    """`source` with each block of `block` values along a row clamped to [-bound, bound], `bound` [N, blocks]
    (AWQ's weight clipping: the quantizer's range shrinks to the bound, a K the block does not divide ends in a
    partial block)."""

    source: WeightSource
    bound: np.ndarray
    block: int

    def __post_init__(self) -> None:
        self.shape, self.dtype = tuple(self.source.shape), self.source.dtype
        if self.bound.shape != (self.shape[0], ceil_div(self.shape[1], self.block)):
            raise ValueError(f"clip bounds {self.bound.shape} do not fit {self.shape} in blocks of {self.block}")

    def materialize(self) -> np.ndarray:
        array = np.array(self.source.materialize(), dtype=np.float32)
        limit = np.repeat(self.bound.astype(np.float32), self.block, axis=1)[:, :self.shape[1]]
        return np.clip(array, -limit, limit)

    def __str__(self) -> str:
        return f"clipped({self.source}, blocks of {self.block})"


def checkpoint_key(source: WeightSource) -> str | None:
    """The checkpoint tensor a (possibly fused or scaled) weight starts with, e.g. for a fused qkv
    weight the q_proj tensor; None for weights the builder computed."""
    while True:
        if hasattr(source, "key"):
            return source.key
        if isinstance(source, Concat):
            source = source.parts[0]
        elif isinstance(source, (ScaledWeight, PermutedColumns, ClippedWeight)):
            source = source.source
        else:
            return None
