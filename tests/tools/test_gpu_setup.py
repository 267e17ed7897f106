"""tools.gpu_setup on CPU with small fake wheels: the bundle splits into parts of the asked size, the
generated one-line commands (run in order, as the lent machine would, one per call) rebuild it, check its
sha256, install every wheel without an index and run the check; a corrupted part fails the sha256 check."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools.gpu_setup import commands, project, stage


def fake_wheel(folder: Path, name: str, payload: int) -> Path:
    """A minimal valid wheel of package `name` with `payload` bytes of random data in it."""
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{name}/__init__.py", f"NAME = {name!r}\n")
        z.writestr(f"{name}/blob.bin", __import__("os").urandom(payload))
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


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
    parts = stage(wheels, root, part_bytes=10_000)
    assert len(parts) >= 4 and all((p / "part").stat().st_size <= 10_000 for p in parts)
    target = tmp_path / "site"
    check = f"PYTHONPATH={target} {sys.executable} -c 'import alpha, beta_pkg; print(alpha.NAME, beta_pkg.NAME)'"
    lines = commands(len(parts), ".gpu", str(tmp_path / "bundle.tar"), str(tmp_path / "wheels"), str(target), check)
    assert len(lines) == len(parts) and all(len(line) < 2000 for line in lines)
    assert "> " in lines[0] and all(">> " in line for line in lines[1:])
    lines = [line.replace("python3 -m pip", f"{sys.executable} -m pip") for line in lines]
    done = run_calls(lines, tmp_path / "repo")
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout and "alpha beta_pkg" in done.stdout


def test_a_corrupted_part_fails_the_checksum(tmp_path):
    root = tmp_path / "repo" / ".gpu"
    root.mkdir(parents=True)
    parts = stage([fake_wheel(tmp_path, "alpha", 25_000)], root, part_bytes=10_000)
    data = (parts[1] / "part").read_bytes()
    (parts[1] / "part").write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # always a change (b"x" was not, 1 in 256)
    lines = commands(len(parts), ".gpu", str(tmp_path / "b.tar"), str(tmp_path / "w"), str(tmp_path / "s"), "true")
    done = run_calls(lines, tmp_path / "repo")
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr


@pytest.mark.parametrize("name, expected", [("onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl",
                                             "onnxruntime-gpu"), ("pydantic_core-2.1-cp312.whl", "pydantic-core")])
def test_project_names(name, expected):
    assert project(Path(name)) == expected


def test_check_refuses_a_machine_without_cuda():
    """Here (CPU onnxruntime) the check's CUDA session falls back to CPU: the runtime's provider check says so."""
    from runtime.manifest.load import EngineError
    from tools.gpu_setup import check_cuda

    with pytest.raises(EngineError, match="for CUDAExecutionProvider and the session runs on"):
        check_cuda()
