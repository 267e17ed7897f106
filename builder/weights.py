"""Lazy weights: references to checkpoint tensors and transforms of them.

Nothing is read until `materialize()` is called by the engine writer, one tensor at a time; the
safetensors files are memory-mapped, so the builder never holds the whole model in memory. A tensor the
writer takes as stored is streamed in blocks of rows (`row_blocks`), so a large float embedding or
lm_head is never held whole in float32."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or tensors."""


class Checkpoint:
    """A Hugging Face checkpoint directory: config.json plus one or many (indexed) safetensors files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise CheckpointError(f"{self.path}: no config.json; expected a Hugging Face checkpoint directory")
        self._file_of = _tensor_files(self.path)
        self._handles: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self._file_of)

    def _file(self, name: str) -> Path:
        if name not in self._file_of:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        return self._file_of[name]

    def _slice(self, name: str):
        from safetensors import safe_open

        file = self._file(name)
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored safetensors dtype: "F32", "F16", "BF16", "I64", ..."""
        return self._slice(name).get_dtype()

    def describe(self, name: str) -> str:
        """How a tensor is named in messages."""
        return name

    def source(self, name: str) -> WeightSource:
        """The lazy weight source of one tensor."""
        return CheckpointTensor(self, name)

    def read(self, name: str) -> np.ndarray:
        """One tensor as float32 numpy (bf16/fp16 checkpoints are widened exactly), in memory of its own.

        The file is mapped for this read only: a float32 tensor would otherwise stay a view into the
        mapping, and every page read would stay resident in the builder until the build ends."""
        from safetensors import safe_open

        with safe_open(str(self._file(name)), framework="pt") as f:
            return _owned(f.get_tensor(name))

    def read_slice(self, name: str, axis: int, lo: int, hi: int) -> np.ndarray:
        """Indices [lo, hi) of one tensor along `axis`, as `read` gives them; nothing else of it is read,
        and the file is mapped for this read only."""
        from safetensors import safe_open

        index = tuple([slice(None)] * axis + [slice(lo, hi)])
        with safe_open(str(self._file(name)), framework="pt") as f:
            return _owned(f.get_slice(name)[index])


def _owned(tensor) -> np.ndarray:
    """float32 (or integer) numpy in memory of its own: a widened bf16/fp16 tensor already is (one copy,
    not two); a float32 or integer one is copied out of the file mapping."""
    if tensor.is_floating_point() and tensor.dtype != _torch_float32():
        return tensor.float().numpy()
    return tensor.numpy().copy()


def _torch_float32():
    import torch

    return torch.float32


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index or the files' headers. A missing shard or a truncated or
    corrupt file is a CheckpointError naming the file (safetensors checks that the header covers the file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_index(index)
        shards = sorted({path / file for file in weight_map.values()})
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard files that are missing: {missing[:4]}; copy the whole "
                                  f"checkpoint directory")
        for shard in shards:
            _open_header(shard)
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (only safetensors checkpoints are read)")
    mapping = {}
    for file in files:
        mapping.update({name: file for name in _open_header(file)})
    return mapping


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index}: not a valid safetensors index (a JSON object with a 'weight_map'): "
                              f"{type(err).__name__}: {err}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
    return weight_map


def _open_header(file: Path) -> list[str]:
    """The tensor names in one safetensors file; a damaged file is an error naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: not a readable safetensors file ({err}); the file is truncated or "
                              f"corrupt, copy or download it again") from None


class WeightSource:
    """A lazily computed weight. Subclasses define shape, dtype, materialize() and a text form."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    def materialize(self) -> np.ndarray:
        raise NotImplementedError

    def row_blocks(self, max_bytes: int) -> Iterator[np.ndarray]:
        """The value in consecutive blocks of rows (axis 0) of at most about `max_bytes` of float32 each;
        by default one block, the whole value."""
        yield self.materialize()


@dataclass(eq=False)
class CheckpointTensor(WeightSource):
    """A tensor read as is from the checkpoint."""

    checkpoint: Checkpoint
    key: str

    def __post_init__(self) -> None:
        self.shape = self.checkpoint.shape(self.key)

    def materialize(self) -> np.ndarray:
        return self.checkpoint.read(self.key)

    def row_blocks(self, max_bytes: int) -> Iterator[np.ndarray]:
        rows = self.shape[0] if self.shape else 1
        row_bytes = 4 * int(np.prod(self.shape[1:], dtype=np.int64))
        step = max(1, max_bytes // max(row_bytes, 1))
        if not self.shape or step >= rows:
            yield self.materialize()
            return
        for lo in range(0, rows, step):
            yield self.checkpoint.read_slice(self.key, 0, lo, min(rows, lo + step))

    def __str__(self) -> str:
        return f'ckpt["{self.key}"]'


@dataclass(eq=False)
class Concat(WeightSource):
    """Parts joined along `axis` (used by the Q/K/V and gate/up fusions)."""

    parts: list[WeightSource]
    axis: int = 0

    def __post_init__(self) -> None:
        first = self.parts[0].shape
        self.dtype = self.parts[0].dtype
        for part in self.parts:
            rest = part.shape[:self.axis] + part.shape[self.axis + 1:]
            if part.dtype != self.dtype or rest != first[:self.axis] + first[self.axis + 1:]:
                raise ValueError(f"concat: part {part} is {part.dtype}{list(part.shape)}, expected "
                                 f"{self.dtype} with shape {list(first)} except on axis {self.axis}")
        size = sum(p.shape[self.axis] for p in self.parts)
        self.shape = first[:self.axis] + (size,) + first[self.axis + 1:]

    def materialize(self) -> np.ndarray:
        return np.concatenate([p.materialize() for p in self.parts], axis=self.axis)

    def __str__(self) -> str:
        return f"concat({', '.join(str(p) for p in self.parts)}, axis={self.axis})"


@dataclass(eq=False)
class ArrayWeight(WeightSource):
    """A small weight computed by the builder itself (rope tables, test fixtures)."""

    array: np.ndarray
    label: str = "array"

    def __post_init__(self) -> None:
        self.shape = tuple(self.array.shape)
        self.dtype = str(self.array.dtype)

    def materialize(self) -> np.ndarray:
        return self.array

    def __str__(self) -> str:
        return f"{self.label}{list(self.shape)}"
