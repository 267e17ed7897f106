"""tools.gpu.setup on CPU with small fake wheels: the unpacked wheels (the files the CUDA provider never loads
left out) pack into parts of the asked size, the generated one-line commands (run in order, as the lent
machine would, one per call) rebuild the bundle, check its sha256, unpack it where Python imports it from and
run what follows (the check); every file that comes out matches its wheel's RECORD checksum; a corrupted part
fails the sha256 check."""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools.gpu.setup import commands, project, stage


def fake_wheel(folder: Path, name: str, payload: int) -> Path:
    """A minimal valid wheel of package `name` with `payload` bytes of random data in it (and a TensorRT provider
    library, which staging leaves out), its RECORD holding each file's sha256 as a real wheel's does."""
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": f"NAME = {name!r}\n".encode(), f"{name}/blob.bin": os.urandom(payload),
             "onnxruntime/capi/libonnxruntime_providers_tensorrt.so": os.urandom(100),
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode()}
    record = "".join(f"{n},sha256={digest(data)},{len(data)}\n" for n, data in files.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for n, data in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(n, data)
    return wheel


def digest(data: bytes) -> str:
    """A wheel RECORD's checksum: urlsafe base64 of the sha256, unpadded."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def run_calls(lines: list[str], cwd: Path) -> subprocess.CompletedProcess:
    for line in lines:  # each line is one device call's command
        done = subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True)
        if done.returncode:
            return done
    return done


def test_split_reassemble_install_and_check(tmp_path):
    wheels = [fake_wheel(tmp_path, "alpha", 30_000), fake_wheel(tmp_path, "beta_pkg", 12_000)]
    root = tmp_path / "repo" / ".gpu"
    root.mkdir(parents=True)
    parts = stage(wheels, root, part_bytes=10_000)  # random payloads: xz cannot shrink them
    assert len(parts) >= 4 and all((p / "part").stat().st_size <= 10_000 for p in parts)
    target = tmp_path / "site"
    check = f"PYTHONPATH={target} {sys.executable} -c 'import alpha, beta_pkg; print(alpha.NAME, beta_pkg.NAME)'"
    lines = commands(len(parts), ".gpu", str(tmp_path / "bundle.tar.xz"), str(target), check)
    assert len(lines) == len(parts) and all(len(line) < 2000 for line in lines)
    assert "> " in lines[0] and all(">> " in line for line in lines[1:])
    lines = [line.replace("python3 -m tarfile", f"{sys.executable} -m tarfile") for line in lines]
    done = run_calls(lines, tmp_path / "repo")
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout and "alpha beta_pkg" in done.stdout
    assert not (target / "onnxruntime").exists()  # LEAVE_OUT
    for wheel in wheels:  # every file that came out is the wheel's own (its RECORD's checksum)
        record = (target / f"{project(wheel).replace('-', '_')}-1.0.dist-info" / "RECORD").read_text().splitlines()
        kept = [line.split(",") for line in record if not line.startswith("onnxruntime/") and "sha256=" in line]
        assert len(kept) == 3 and all(f"sha256={digest((target / n).read_bytes())}" == h for n, h, _ in kept)


def test_a_corrupted_part_fails_the_checksum(tmp_path):
    root = tmp_path / "repo" / ".gpu"
    root.mkdir(parents=True)
    parts = stage([fake_wheel(tmp_path, "alpha", 25_000)], root, part_bytes=10_000)
    data = (parts[1] / "part").read_bytes()
    (parts[1] / "part").write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # always a change (b"x" was not, 1 in 256)
    lines = commands(len(parts), ".gpu", str(tmp_path / "b.tar.xz"), str(tmp_path / "s"), "true")
    done = run_calls(lines, tmp_path / "repo")
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr


@pytest.mark.parametrize("name, expected", [("onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl",
                                             "onnxruntime-gpu"), ("pydantic_core-2.1-cp312.whl", "pydantic-core")])
def test_project_names(name, expected):
    assert project(Path(name)) == expected


def test_check_refuses_a_machine_without_cuda():
    """Here (CPU onnxruntime) the check's CUDA session falls back to CPU: the runtime's provider check says so."""
    from runtime.manifest.load import EngineError
    from tools.gpu.setup import check_session

    with pytest.raises(EngineError, match="for CUDAExecutionProvider and the session runs on"):
        check_session("cuda")
    assert "CPUExecutionProvider" in check_session("cpu")
