"""manifest.json validation on a small directory of fake engine files (no build needed)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from runtime.manifest.load import FORMAT_VERSION, MANIFEST, EngineError, file_entries, load_manifest, sha256_file

SECTIONS = ("model", "target", "limits", "kv_cache", "rope", "io", "files")
FILES = {"model.onnx": b"onnx-graph" * 10, "model.onnx.data": bytes(range(256)) * 40,
         "tokenizer.json": b'{"model": {}}', "empty.txt": b""}


def write_manifest(directory: Path, manifest: dict) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


@pytest.fixture
def engine(tmp_path) -> Path:
    directory = tmp_path / "engine"
    directory.mkdir()
    for name, data in FILES.items():
        (directory / name).write_bytes(data)
    write_manifest(directory, {
        "format_version": FORMAT_VERSION,
        "model": {"family": "llama"}, "target": {"device": "cpu"}, "limits": {"max_seq_len": 64},
        "kv_cache": {"slots": 1}, "rope": {"type": "default"}, "io": {"inputs": {}, "outputs": {}},
        "files": file_entries(directory),
    })
    return directory


def manifest_of(engine: Path) -> dict:
    return json.loads((engine / MANIFEST).read_text())


def test_file_entries_hash_every_file_but_the_manifest(engine):
    entries = file_entries(engine)
    assert sorted(entries) == sorted(FILES)
    for name, data in FILES.items():
        assert entries[name] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert sha256_file(engine / "model.onnx.data", chunk=7) == entries["model.onnx.data"]["sha256"]


def test_intact_engine_loads(engine):
    manifest = load_manifest(engine)
    assert manifest["format_version"] == FORMAT_VERSION
    assert set(SECTIONS) <= set(manifest) and sorted(manifest["files"]) == sorted(FILES)
    assert load_manifest(str(engine)) == manifest  # a str path works too


def test_extra_unlisted_file_is_tolerated(engine):
    (engine / "notes.txt").write_text("added later")
    load_manifest(engine)


def test_missing_manifest(tmp_path):
    with pytest.raises(EngineError, match="no manifest.json; not an engine directory"):
        load_manifest(tmp_path)
    with pytest.raises(EngineError, match="does-not-exist: no such directory"):  # #23: say the path is missing
        load_manifest(tmp_path / "does-not-exist")


def test_invalid_json(engine):
    (engine / MANIFEST).write_text('{"format_version": 1,')
    with pytest.raises(EngineError, match="not valid JSON .*the manifest is damaged, rebuild the engine") as info:
        load_manifest(engine)
    assert isinstance(info.value.__cause__, json.JSONDecodeError)


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 0, "1", None])
def test_wrong_format_version(engine, version):
    manifest = manifest_of(engine)
    manifest["format_version"] = version
    write_manifest(engine, manifest)
    with pytest.raises(EngineError) as info:
        load_manifest(engine)
    message = str(info.value)
    assert f"engine format version {version!r}, this runtime reads version {FORMAT_VERSION}" in message
    assert "rebuild the engine" in message


def test_missing_format_version(engine):
    manifest = manifest_of(engine)
    del manifest["format_version"]
    write_manifest(engine, manifest)
    with pytest.raises(EngineError, match="engine format version None"):
        load_manifest(engine)


@pytest.mark.parametrize("section", SECTIONS)
def test_missing_section(engine, section):
    manifest = manifest_of(engine)
    del manifest[section]
    write_manifest(engine, manifest)
    with pytest.raises(EngineError, match=f"manifest lacks the '{section}' section; the engine is incomplete"):
        load_manifest(engine)


def test_missing_file(engine):
    (engine / "model.onnx.data").unlink()
    with pytest.raises(EngineError, match="file model.onnx.data listed in the manifest is missing"):
        load_manifest(engine)


def test_truncated_file(engine):
    path = engine / "model.onnx.data"
    path.write_bytes(FILES["model.onnx.data"][:-100])
    size = len(FILES["model.onnx.data"])
    with pytest.raises(EngineError) as info:
        load_manifest(engine)
    message = str(info.value)
    assert str(path) in message
    assert f"{size - 100} bytes, the manifest says {size}; the file is truncated or replaced" in message


def test_same_size_modified_file(engine):
    path = engine / "model.onnx.data"
    data = bytearray(FILES["model.onnx.data"])
    data[1234] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="sha256 differs from the manifest; the file was modified after the build"):
        load_manifest(engine)


def test_check_files_false_skips_file_checks(engine):
    (engine / "model.onnx").unlink()
    (engine / "model.onnx.data").write_bytes(b"x")
    assert load_manifest(engine, check_files=False)["format_version"] == FORMAT_VERSION
    with pytest.raises(EngineError):
        load_manifest(engine)


def test_engine_error_is_a_value_error(engine):
    (engine / MANIFEST).unlink()
    with pytest.raises(ValueError):
        load_manifest(engine)


# -- regressions: bugs found by these tests and fixed ---------------------------------------------
def test_regression_manifest_that_is_not_an_object(engine):
    (engine / MANIFEST).write_text("[]")
    with pytest.raises(EngineError):
        load_manifest(engine)


def test_regression_binary_garbage_manifest(engine):
    (engine / MANIFEST).write_bytes(b"\xff\xfe\x00\x01garbage")
    with pytest.raises(EngineError):
        load_manifest(engine)


def test_regression_malformed_files_entry(engine):
    manifest = manifest_of(engine)
    manifest["files"]["model.onnx"] = {}
    write_manifest(engine, manifest)
    with pytest.raises(EngineError):
        load_manifest(engine)
