"""Open a GGUF model file (or a split one, `-00001-of-0000N.gguf`) and check it before anything is built.

The `gguf` package's GGUFReader memory-maps each file: metadata is parsed into small arrays and every
tensor's data stays a view into the mapping until it is read, one tensor at a time. A file it cannot parse
(truncated, a string or array running past the end, an unknown tensor type, absurd counts or dimensions,
a tensor's data past the end) is a GGUFError naming the file and the problem."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from builder.weights import CheckpointError

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_DIMS = 4  # GGML_MAX_DIMS


class GGUFError(CheckpointError):
    """A GGUF file that cannot be read as a model."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `type` the GGML type name ("Q4_1", "F32", ...), `shape` in numpy (row-major) order
    [..., rows, columns], `data` the raw view into the memory map (bytes [rows, row bytes] for a block
    type, the elements for a float or integer type), `file` the part holding it."""

    name: str
    type: str
    shape: tuple[int, ...]
    data: np.ndarray
    file: Path


@dataclass
class GGUFModel:
    """The metadata (every key -> plain Python value, arrays as lists) and the tensors of one model."""

    path: Path
    files: list[Path]
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no 'general.architecture' string in the metadata; not a model file")
        return arch


def split_parts(path: Path) -> list[Path]:
    """All the files of a split GGUF given any one of them, in order; [path] for a single file."""
    match = SPLIT.match(path.name)
    if not match:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"{path}: a split GGUF of {count} files; missing {missing[:4]} beside it")
    return parts


def open_gguf(path: str | Path) -> GGUFModel:
    """The model in `path` (all parts of a split file), checked: every tensor's data lies inside its file,
    no tensor name repeats across parts. Metadata comes from the first part; tensors from all. The last
    file opened is kept open (parsing a large vocabulary takes seconds; a build opens the file twice)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    files = split_parts(path)
    return _open(path.resolve(), tuple((f.resolve(), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=1)
def _open(path: Path, stats: tuple) -> GGUFModel:
    """`stats` ((file, size, mtime) of every part) keys the cache: a changed part is read again."""
    files = [file for file, _, _ in stats]
    metadata: dict[str, Any] = {}
    tensors: dict[str, GGUFTensor] = {}
    for index, file in enumerate(files):
        reader = _reader(file)
        if index == 0:
            metadata = {key: _value(file, key, field) for key, field in reader.fields.items()}
        for t in reader.tensors:
            if t.name in tensors:
                raise GGUFError(f"{file}: tensor {t.name!r} is also in {tensors[t.name].file.name}")
            tensors[t.name] = _tensor(file, reader, t)
    return GGUFModel(path, files, metadata, tensors)


def _reader(file: Path):
    from gguf import GGUFReader

    size = file.stat().st_size
    if size < 24:
        raise GGUFError(f"{file}: {size} bytes, too short for a GGUF header (24 bytes); the file is truncated")
    _check_counts(file, size)
    try:
        return GGUFReader(file)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError, UnicodeDecodeError) as err:
        raise GGUFError(f"{file}: not a readable GGUF file: {_why(err)}; the file is truncated, corrupt or "
                        f"not GGUF") from None


def _check_counts(file: Path, size: int) -> None:
    """The header's tensor and metadata counts against the file size (a tensor's description takes at
    least 32 bytes, a key-value pair 13), before anything loops over them."""
    with file.open("rb") as f:
        head = f.read(24)
    if head[:4] != b"GGUF":
        return  # GGUFReader names the bad magic
    tensors, keys = np.frombuffer(head[8:24], "<u8")
    if int(tensors) * 32 + int(keys) * 13 > size:
        raise GGUFError(f"{file}: the header claims {int(tensors)} tensors and {int(keys)} metadata keys, more than "
                        f"a file of {size} bytes can describe; the file is corrupt")


def _why(err: Exception) -> str:
    text = " ".join(str(err).split())[:200]
    if "GGMLQuantizationType" in text:
        return f"a tensor has an unknown GGML type ({text})"
    if "GGUFValueType" in text:
        return f"a metadata value has an unknown type ({text})"
    if "cannot reshape" in text or "buffer is smaller" in text or "index" in text and "out of bounds" in text:
        return f"a string, array or tensor runs past the end of the file ({type(err).__name__}: {text})"
    return f"{type(err).__name__}: {text}"


def _value(file: Path, key: str, field) -> Any:
    """A metadata field as plain Python: str, int, float, bool, or a list of them."""
    try:
        value = field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as err:
        raise GGUFError(f"{file}: metadata key {key!r} cannot be read: {_why(err)}") from None
    return value.tolist() if isinstance(value, np.ndarray) else value


def _tensor(file: Path, reader, t) -> GGUFTensor:
    from gguf import GGML_QUANT_SIZES

    dims = [int(d) for d in t.shape]
    if not 1 <= len(dims) <= MAX_DIMS or any(d < 1 for d in dims):
        raise GGUFError(f"{file}: tensor {t.name!r} has dimensions {dims}; expected 1 to {MAX_DIMS} positive sizes")
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    if dims[0] % block:
        raise GGUFError(f"{file}: tensor {t.name!r} ({t.tensor_type.name}) has rows of {dims[0]} values, not a "
                        f"multiple of its block of {block}")
    elements = int(np.prod(dims, dtype=object))
    end = t.data_offset + elements // block * type_size
    if end > len(reader.data) or t.data.nbytes != elements // block * type_size:
        raise GGUFError(f"{file}: tensor {t.name!r} ({t.tensor_type.name} {dims}) has its data at bytes "
                        f"{t.data_offset}..{end}, past the end of the file ({len(reader.data)} bytes); the file "
                        f"is truncated")
    rows = tuple(reversed(dims))
    return GGUFTensor(t.name, t.tensor_type.name, rows, t.data, file)
