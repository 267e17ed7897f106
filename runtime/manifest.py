"""manifest.json: what an engine is, what it was built from, and the hash of every file in it.
Loading validates it and explains any mismatch instead of failing later in a kernel."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class EngineError(ValueError):
    """The engine directory is missing, tampered with, truncated or incompatible."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_entries(directory: Path) -> dict[str, dict]:
    """sha256 and size of every file in the engine directory except the manifest itself."""
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}


def load_manifest(engine_dir: str | Path, check_files: bool = True) -> dict:
    """Read and validate manifest.json; with `check_files`, verify each file's size and sha256."""
    directory = Path(engine_dir)
    path = directory / MANIFEST
    if not path.is_file():
        raise EngineError(f"{directory}: no {MANIFEST}; not an engine directory (build one with engine-build)")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise EngineError(f"{path}: not valid JSON ({err}); the manifest is damaged, rebuild the engine") from err
    if not isinstance(manifest, dict):
        raise EngineError(f"{path}: a manifest is a JSON object, got {type(manifest).__name__}; rebuild the engine")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise EngineError(f"{path}: engine format version {version!r}, this runtime reads version "
                          f"{FORMAT_VERSION}; rebuild the engine with this version's engine-build")
    for key in ("model", "target", "limits", "kv_cache", "rope", "io", "files"):
        if key not in manifest:
            raise EngineError(f"{path}: manifest lacks the {key!r} section; the engine is incomplete")
    if check_files:
        _check_files(directory, manifest["files"])
    return manifest


def _check_files(directory: Path, files: dict[str, dict]) -> None:
    for name, entry in files.items():
        if Path(name).name != name or not isinstance(entry, dict) or not {"bytes", "sha256"} <= set(entry):
            raise EngineError(f"{directory}: manifest file entry {name!r}: {entry!r} is malformed "
                              f"(expected a plain file name with 'bytes' and 'sha256')")
        path = directory / name
        if not path.is_file():
            raise EngineError(f"{directory}: file {name} listed in the manifest is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise EngineError(f"{path}: {size} bytes, the manifest says {entry['bytes']}; the file is "
                              f"truncated or replaced")
        if sha256_file(path) != entry["sha256"]:
            raise EngineError(f"{path}: sha256 differs from the manifest; the file was modified after the build")
