"""The text every machine has without a download: this interpreter's own standard library source.

tools/checkpoints/train_tiny_model.py trains on it, tools/accuracy.py and engine-bench's speculative workload read
its held-out files. Files are split into training and held-out ones by a hash of their relative path."""
from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

HELDOUT_BUCKETS = 20
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "pydoc_data", "encodings"}
)
HELDOUT_LIST = Path(__file__).resolve().parent.parent / "data" / "heldout_files.txt"


def stdlib_root() -> Path:
    """Directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_relative(path: Path) -> str:
    """`path` relative to the stdlib directory, as a posix string."""
    return path.relative_to(stdlib_root()).as_posix()


def _selected(rel: str) -> bool:
    parts = rel.split("/")
    return not EXCLUDED_DIRS.intersection(parts[:-1]) and not parts[-1].startswith("test_")


def _is_heldout(rel: str) -> bool:
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_BUCKETS == 0


def corpus_files() -> list[Path]:
    """All selected stdlib .py files (no test dirs, site-packages, codec tables or pydoc data), sorted."""
    files = []
    for folder, subdirs, names in os.walk(stdlib_root()):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]
        paths = (Path(folder, name) for name in names if name.endswith(".py"))
        files += [p for p in paths if p.is_file() and _selected(stdlib_relative(p))]
    return sorted(files, key=stdlib_relative)


def heldout_files() -> list[Path]:
    """The evaluation files: those whose relative path hashes (sha256) to bucket 0 of 20."""
    return [p for p in corpus_files() if _is_heldout(stdlib_relative(p))]


def training_files() -> list[Path]:
    """The training files: every selected stdlib file that is not held out."""
    return [p for p in corpus_files() if not _is_heldout(stdlib_relative(p))]


def recorded_heldout_files() -> list[Path]:
    """The held-out files as recorded at training time (data/heldout_files.txt, which
    tests/builder/test_trained_checkpoint.py checks against `heldout_files()`); `heldout_files()` itself, which
    walks the whole stdlib directory, only when a recorded file is missing."""
    lines = HELDOUT_LIST.read_text().splitlines() if HELDOUT_LIST.is_file() else []
    paths = [stdlib_root() / line for line in lines if line and not line.startswith("#")]
    return paths if paths and all(p.is_file() for p in paths) else heldout_files()


def read_source(path: Path) -> str:
    """A source file's text (utf-8, undecodable bytes replaced)."""
    return path.read_bytes().decode("utf-8", errors="replace")
