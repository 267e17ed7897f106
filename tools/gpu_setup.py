"""Ready a lent GPU machine, which has no package index, in a few calls: run here, this downloads every wheel
the GPU steps need and that machine lacks, bundles them into one tar, splits it into parts small enough for
one call each (a call carries at most 64 MiB with the working tree), and writes one command per part.

    python -m tools.gpu_setup stage [--server]    # here: .gpu/p0 .. .gpu/pN and .gpu/COMMANDS.txt
    python -m tools.gpu_setup check               # there (the last part's command runs it): a CUDA session

On the lent machine, call `run` once per part in order with `carry: [".gpu/pI"]` and the command COMMANDS.txt
gives for it; the first part's command starts the bundle, the last one checks its sha256, installs the wheels
into /tmp/ortgpu and opens a tiny CUDA session whose providers must start with CUDAExecutionProvider. Later
calls: `export PYTHONPATH=/tmp/ortgpu:$PWD`. docs/GPU.md has the whole procedure and the number of calls."""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import click

ORT_GPU = "onnxruntime-gpu==1.31.1"  # built for CUDA 13 (pyproject's gpu extra); its nvidia-* needs are on the machine
SERVER = ("fastapi", "uvicorn", "openai")  # engine-serve and its OpenAI-client tests, with what they need
# What the lent machines' image already holds (/work/.library/device/KINDS.md, read 2026-11-17): not carried.
MACHINE_HAS = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle colorama cuda-bindings cuda-core cuda-pathfinder cupy-cuda13x filelock flatbuffers
fsspec h11 hf-xet httpcore httpx huggingface-hub idna jinja2 markupsafe ml-dtypes mpmath msgpack multidict networkx
numpy onnx packaging pillow pip pluggy prometheus-client propcache protobuf psutil pygments pytest python-dateutil
pyyaml regex requests rich safetensors setuptools six sympy tokenizers torch tqdm transformers typing-extensions
urllib3 uvloop wheel yarl""".split())
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
PART_MIB = 50  # + the project's own files (~14 MiB) stays under a call's 64 MiB
BUNDLE, WHEELS, TARGET = "/tmp/gpu-bundle.tar", "/tmp/gpu-wheels", "/tmp/ortgpu"
CHECK = "PYTHONPATH=/tmp/ortgpu:$PWD python3 -m tools.gpu_setup check"


def project(wheel: Path) -> str:
    """A wheel's project name, normalized (onnxruntime_gpu-1.31.1-... -> onnxruntime-gpu)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def download(dest: Path, server: bool) -> list[Path]:
    """onnxruntime-gpu alone (its needs are on the machine), and with --server the server packages with their
    needs; then every wheel of a project the machine already has is dropped."""
    dest.mkdir(parents=True, exist_ok=True)
    common = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
              "--implementation", "cp", "-d", str(dest)] + [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(common + ["--no-deps", ORT_GPU], check=True)
    if server:
        subprocess.run(common + list(SERVER), check=True)
    for wheel in dest.glob("*.whl"):
        if project(wheel) in MACHINE_HAS:
            wheel.unlink()
    return sorted(dest.glob("*.whl"))


def stage(wheels: list[Path], root: Path, part_bytes: int = PART_MIB << 20) -> list[Path]:
    """Bundle `wheels` into root/bundle.tar and split it into root/p0/part, root/p1/part, ... (each with the
    bundle's SHA256 beside it); returns the part folders in order."""
    bundle = root / "bundle.tar"
    with tarfile.open(bundle, "w") as tar:
        for wheel in wheels:
            tar.add(wheel, arcname=wheel.name)
    digest = hashlib.sha256(bundle.read_bytes()).hexdigest()
    for old in root.glob("p[0-9]*"):
        shutil.rmtree(old)
    parts = []
    with open(bundle, "rb") as source:
        while chunk := source.read(part_bytes):
            folder = root / f"p{len(parts)}"
            folder.mkdir()
            (folder / "part").write_bytes(chunk)
            (folder / "SHA256").write_text(digest + "\n")
            parts.append(folder)
    return parts


def commands(parts: int, root: str = ".gpu", bundle: str = BUNDLE, wheels: str = WHEELS, target: str = TARGET,
             check: str = CHECK) -> list[str]:
    """One shell line per part: the first starts the bundle, the others append to it; the last also checks
    the sha256, unpacks, installs every wheel into `target` (no index, no dependencies) and runs `check`."""
    lines = []
    for i in range(parts):
        line = f"cat {root}/p{i}/part {'>' if i == 0 else '>>'} {bundle} && ls -l {bundle}"
        if i == parts - 1:
            line = (f"cat {root}/p{i}/part {'>' if i == 0 else '>>'} {bundle} && echo \"$(cat {root}/p{i}/SHA256)  "
                    f"{bundle}\" | sha256sum -c && rm -rf {wheels} && mkdir -p {wheels} && tar -xf {bundle} -C {wheels} "
                    f"&& python3 -m pip install -q --no-index --no-deps --no-compile --target {target} {wheels}/*.whl "
                    f"&& {check}")
        lines.append(line)
    return lines


def check_cuda() -> None:
    """Open a tiny CUDA session through the runtime's own check (runtime/model/device.py: CUDA libraries
    preloaded, the session's providers must start with CUDA) and run it once."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from runtime.model.device import open_session

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "check", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    session = open_session(model.SerializeToString(), ort.SessionOptions(),
                           ["CUDAExecutionProvider", "CPUExecutionProvider"])
    y = session.run(None, {"x": np.arange(4, dtype=np.float32)})[0]
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0], y
    print(f"onnxruntime {ort.__version__} from {Path(ort.__file__).parent}: session on {session.get_providers()}, ok")


@click.group()
def main() -> None:
    """Stage wheels for a lent GPU machine (here) or check the CUDA provider (there)."""


@main.command("stage")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path(".gpu"), show_default=True,
              help="Where the parts go (ignored by git: add /.gpu/ to .git/info/exclude).")
@click.option("--server", is_flag=True, help="Also fastapi, uvicorn and openai (engine-serve and its tests).")
@click.option("--part-mib", type=int, default=PART_MIB, show_default=True)
def stage_command(root: Path, server: bool, part_mib: int) -> None:
    """Download, bundle and split; print one command per part (also written to ROOT/COMMANDS.txt)."""
    wheels = download(root / "dl", server)
    parts = stage(wheels, root, part_mib << 20)
    lines = commands(len(parts), str(root))
    (root / "COMMANDS.txt").write_text("\n".join(f'carry ["{root}/p{i}"]: {c}' for i, c in enumerate(lines)) + "\n")
    click.echo(f"{len(wheels)} wheels ({', '.join(w.name for w in wheels)}) in {len(parts)} parts:")
    for i, line in enumerate(lines):
        click.echo(f'  call {i + 1}, carry ["{root}/p{i}"]: {line}')


@main.command("check")
def check_command() -> None:
    """On the GPU machine: a tiny CUDA session must run on CUDAExecutionProvider."""
    check_cuda()


if __name__ == "__main__":
    main()
