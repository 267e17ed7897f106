"""Ready a lent GPU machine, which has no package index, in as few calls as its 64 MiB per call allow: here,
`stage` downloads onnxruntime-gpu (and with --server what engine-serve needs that the machine lacks), unpacks
the wheels, leaves out what the CUDA provider never loads, packs the rest with xz and splits it into parts of
PART_MIB, each small enough to travel beside the working tree (at most TREE_MIB); `plan` (= `python -m
tools.gpu.check --dry-run`) writes one command per call to .gpu/COMMANDS.txt: the first calls carry a part
each, the last carries the last part, checks the bundle's sha256, unpacks it into /tmp/ortgpu and runs the
whole check (tools.gpu.check) in the same call.

    python -m tools.gpu.setup stage [--server]    # here: .gpu/p0 .. .gpu/pN, then the plan
    python -m tools.gpu.setup plan                # here: the calls, their bytes and the time budget
    python -m tools.gpu.setup check               # there: a tiny CUDA session must run on CUDA

docs/GPU.md has the whole sequence and what to do when a call fails midway."""
from __future__ import annotations

import fnmatch
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[2]
ORT_GPU = "onnxruntime-gpu==1.31.1"  # built for CUDA 13 (pyproject's gpu extra); its nvidia-* needs are on the machine
WHEEL_BYTES = 255_569_273  # its manylinux_2_28 wheel, measured 2026-11-26
BUNDLE_MIB = 186  # that wheel unpacked, LEAVE_OUT left out, xz -9 (the plan before `stage` has run)
SERVER = ("fastapi", "uvicorn", "openai")  # engine-serve and its OpenAI-client tests, with what they need
GGUF = ("gguf",)  # transformers' GGUF loading (the SmolLM2 reference on the GPU); its needs are on the machine
SMOLLM2 = "smollm2.gguf"  # the real model's file inside the bundle (--smollm2): /tmp/ortgpu/smollm2.gguf there
# What the lent machines' image already holds (/work/.library/device/KINDS.md, read 2026-11-17): not carried.
MACHINE_HAS = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle colorama cuda-bindings cuda-core cuda-pathfinder cupy-cuda13x filelock flatbuffers
fsspec h11 hf-xet httpcore httpx huggingface-hub idna jinja2 markupsafe ml-dtypes mpmath msgpack multidict networkx
numpy onnx packaging pillow pip pluggy prometheus-client propcache protobuf psutil pygments pytest python-dateutil
pyyaml regex requests rich safetensors setuptools six sympy tokenizers torch tqdm transformers typing-extensions
urllib3 uvloop wheel yarl""".split())
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CALL_MIB, TREE_MIB = 64, 14  # what one call carries; the project's own files, kept under this
PART_MIB = CALL_MIB - TREE_MIB
BUNDLE, TARGET = "/tmp/gpu-bundle.tar.xz", "/tmp/ortgpu"
# Files of onnxruntime-gpu that the CUDA provider never loads: the TensorRT provider, and the C API library
# (the Python module's pybind .so holds the whole runtime; only the wheel's RECORD names libonnxruntime.so)
LEAVE_OUT = ("onnxruntime/capi/libonnxruntime_providers_tensorrt.so", "onnxruntime/capi/libonnxruntime.so.*")
ENV = "export PYTHONPATH=/tmp/ortgpu:$PWD PYTHONUNBUFFERED=1"
CHECK = f"{ENV} && python3 -m tools.gpu.check --quick --out $OUT"
# The time budget's parts that are not the check itself (seconds; a lent H100 measured 2026-11-26: start ~29,
# a transfer call ~5-8 of lease, unpack a few: kept with a margin)
BUDGET_S, START_S, CALL_S, UNPACK_S, MIN_START_S = 900, 60, 10, 15, 240


def project(wheel: Path) -> str:
    """A wheel's project name, normalized (onnxruntime_gpu-1.31.1-... -> onnxruntime-gpu)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def download(dest: Path, server: bool, smollm2: bool = False) -> list[Path]:
    """onnxruntime-gpu alone (its needs are on the machine), with --server the server packages and with
    --smollm2 gguf, with their needs; then every wheel of a project the machine already has is dropped."""
    dest.mkdir(parents=True, exist_ok=True)
    common = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
              "--implementation", "cp", "-d", str(dest)] + [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(common + ["--no-deps", ORT_GPU], check=True)
    if server or smollm2:
        subprocess.run(common + list(SERVER if server else ()) + list(GGUF if smollm2 else ()), check=True)
    for wheel in dest.glob("*.whl"):
        if project(wheel) in MACHINE_HAS:
            wheel.unlink()
    return sorted(dest.glob("*.whl"))


def stage(wheels: list[Path], root: Path, part_bytes: int = PART_MIB << 20, files: dict[str, Path] = {}) -> list[Path]:
    """Unpack `wheels` (a wheel unpacked is an installed package: nothing to run there but an extraction), leave out
    LEAVE_OUT, pack the rest into root/bundle.tar.xz (xz -9: measured 2026-11-26, onnxruntime-gpu's 243.7 MiB
    wheel becomes BUNDLE_MIB, 4 parts instead of 5) and split it into root/p0/part, root/p1/part, ... (each with
    the bundle's SHA256 beside it); returns the part folders in order."""
    tree = root / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tree, [n for n in z.namelist() if not any(fnmatch.fnmatch(n, p) for p in LEAVE_OUT)])
    for name, path in files.items():  # other files the check reads there (--smollm2: the real model's GGUF)
        shutil.copyfile(path, tree / name)
    bundle = root / "bundle.tar.xz"
    with tarfile.open(bundle, "w:xz", preset=9) as tar:
        for path in sorted(tree.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(tree)), recursive=False)
    shutil.rmtree(tree)
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


def commands(parts: int, root: str = ".gpu", bundle: str = BUNDLE, target: str = TARGET, then: str = CHECK) -> list[str]:
    """One shell line per part: the first starts the bundle, the others append to it; the last also checks
    the sha256, unpacks it into `target` (Python's own tarfile: no xz program needed there) and runs `then`."""
    lines = []
    for i in range(parts):
        line = f"cat {root}/p{i}/part {'>' if i == 0 else '>>'} {bundle} && ls -l {bundle}"
        if i == parts - 1:
            line = (f"cat {root}/p{i}/part {'>' if i == 0 else '>>'} {bundle} && echo \"$(cat {root}/p{i}/SHA256)  "
                    f"{bundle}\" | sha256sum -c && rm -rf {target} && python3 -m tarfile -e {bundle} {target} "
                    f"&& {then}")
        lines.append(line)
    return lines


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what travels with every call: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.decode().split("\0")
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def part_sizes(root: Path) -> list[int]:
    """The staged parts' sizes, or (nothing staged yet) those the wheel alone will split into."""
    staged = sorted(root.glob("p[0-9]*/part"), key=lambda p: int(p.parent.name[1:]))
    if staged:
        return [p.stat().st_size for p in staged]
    whole, part = divmod(BUNDLE_MIB << 20, PART_MIB << 20)
    return [PART_MIB << 20] * whole + ([part] if part else [])


def plan(root: Path, deadline_s: float, estimates: dict[str, int]) -> str:
    """The device calls (carry, bytes, command) written to root/COMMANDS.txt, and the time budget: the machine's
    start, each call, the install and the check's deadline against BUDGET_S; which steps the estimates fit."""
    tree, parts = tree_bytes(), part_sizes(root)
    lines = commands(len(parts), root.name)
    calls = [f'call {i + 1} of {len(lines)}: carry [".gpu/p{i}"], {(tree + size) / 2**20:.1f} MiB '
             f"(tree {tree / 2**20:.1f} + part {size / 2**20:.1f}):\n  {line}" for i, (size, line) in enumerate(zip(parts, lines))]
    calls.append(f"if the check must run again on the same warm machine (no carry):\n  {CHECK}")
    over = [f"  OVER: call {i + 1} carries more than {CALL_MIB} MiB" for i, s in enumerate(parts) if tree + s > CALL_MIB << 20]
    spent = START_S + CALL_S * len(parts) + UNPACK_S + deadline_s
    fits, clock = [], 0
    for name, seconds in estimates.items():
        clock += seconds
        fits.append(f"{name} ~{seconds} s (by {clock} s){'' if clock <= deadline_s else '  <- after the deadline'}")
    budget = [f"time budget (s; a guess until measured): start {START_S} + {len(parts)} calls x {CALL_S} + unpack "
              f"{UNPACK_S} + the check's deadline {deadline_s:.0f} = {spent:.0f} of {BUDGET_S}: "
              f"{BUDGET_S - spent:.0f} left (a fresh machine needs {MIN_START_S}); give the machine back at once after",
              "the check's steps (estimates on the GPU, not yet measured): " + "; ".join(fits)]
    root.mkdir(parents=True, exist_ok=True)  # /.gpu/ is in .gitignore: the parts travel only when carried
    (root / "COMMANDS.txt").write_text("\n".join(calls) + "\n")
    return "\n".join(calls + over + budget + [f"written to {root / 'COMMANDS.txt'}"])


def check_session(device: str) -> str:
    """Open a tiny session on `device`'s provider through the runtime's own check (runtime/model/device.py: CUDA
    libraries preloaded, the session must run on the provider asked for, else an EngineError says why), run it
    once, and describe it."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from runtime.model.device import open_session

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "check", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    wanted = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
    session = open_session(model.SerializeToString(), ort.SessionOptions(), list(dict.fromkeys([wanted, "CPUExecutionProvider"])))
    y = session.run(None, {"x": np.arange(4, dtype=np.float32)})[0]
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0], y
    return f"onnxruntime {ort.__version__} from {Path(ort.__file__).parent}: {session.get_providers()}"


@click.group()
def main() -> None:
    """Stage wheels for a lent GPU machine and plan its calls (here), or check the CUDA provider (there)."""


@main.command("stage")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path(".gpu"), show_default=True,
              help="Where the parts go (ignored by git: add /.gpu/ to .git/info/exclude).")
@click.option("--server", is_flag=True, help="Also fastapi, uvicorn and openai (engine-serve and its tests).")
@click.option("--smollm2", is_flag=True, help="Also SmolLM2's GGUF (checkpoints/smollm2, fetched first) and gguf: "
              "issue 46's smollm2-cuda step (~95 MiB more: two more parts).")
@click.option("--part-mib", type=int, default=PART_MIB, show_default=True)
def stage_command(root: Path, server: bool, smollm2: bool, part_mib: int) -> None:
    """Download, bundle and split; print the plan (also written to ROOT/COMMANDS.txt)."""
    from tools.checkpoints.fetch import MODELS, fetch
    from tools.gpu.check import DEADLINE_S, PLANS, STEPS

    wheels = download(root / "dl", server, smollm2)
    files = {SMOLLM2: fetch(MODELS["smollm2"], ROOT / "checkpoints")} if smollm2 else {}
    parts = stage(wheels, root, part_mib << 20, files)
    click.echo(f"{len(wheels)} wheels ({', '.join(w.name for w in wheels)}) in {len(parts)} parts")
    click.echo(plan(root, DEADLINE_S, {n: STEPS[n].estimate_s for n in PLANS["default"]}))


@main.command("plan")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path(".gpu"), show_default=True)
@click.option("--deadline-s", type=float, default=None, help="The check's deadline (default: its own).")
def plan_command(root: Path, deadline_s: float | None) -> None:
    """Print the planned calls, their bytes and the time budget; write ROOT/COMMANDS.txt."""
    from tools.gpu.check import DEADLINE_S, PLANS, STEPS

    click.echo(plan(root, deadline_s or DEADLINE_S, {n: STEPS[n].estimate_s for n in PLANS["default"]}))


@main.command("check")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
def check_command(device: str) -> None:
    """On the GPU machine: a tiny session must run on the CUDA provider."""
    click.echo(check_session(device))


if __name__ == "__main__":
    main()
