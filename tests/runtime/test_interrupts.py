"""Ctrl-C at several moments of real engine-run / engine-build processes: exit 130, one line, no traceback,
no abort, partial output flushed; an interrupted build leaves no partial folder and the old engine intact.
Also: stale partial folders of dead builds are removed by the next build of the same output."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from builder.build import build_engine
from builder.output_dir import remove_stale
from builder.recipe import load_recipe
from tools.checkpoints.make_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory) -> Path:
    """A tiny engine that can generate a few thousand tokens: long enough to be interrupted mid-stream."""
    ckpt = make_checkpoint(tmp_path_factory.mktemp("long") / "ckpt", max_position_embeddings=4096, seed=3)
    recipe = load_recipe(base={"model": str(ckpt)}, overrides=["limits.max_seq_len=4096", "limits.max_batch_size=1",
                                                               "verify.enabled=off"])
    return build_engine(recipe, tmp_path_factory.mktemp("engine") / "long", log=lambda _: None)


def _start(module: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _interrupt(proc: subprocess.Popen, library: str | None, delay: float, line: str | None,
               watch: str = "stdout") -> tuple[int, str, str]:
    """SIGINT `delay` seconds after the shared library `library` is loaded (the process is then in our code,
    importing) or after the `watch` stream (engine-run's text: stdout; engine-build's log: stderr) shows
    `line`; returns (exit code, stdout, stderr)."""
    out: list[str] = []
    seen = threading.Event()
    watched, other = (proc.stdout, proc.stderr) if watch == "stdout" else (proc.stderr, proc.stdout)

    def read() -> None:
        for raw in iter(lambda: watched.read1(4096), b""):
            out.append(raw.decode(errors="replace"))
            if line is None or line in "".join(out):
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if library is not None:
        _wait_for_library(proc, library)
    else:
        assert seen.wait(60), f"never saw {line!r}: {''.join(out)!r}"
    time.sleep(delay)
    assert proc.poll() is None, "the process ended before the interrupt; the test moment is too late"
    proc.send_signal(signal.SIGINT)
    rest = other.read().decode(errors="replace")
    code = proc.wait(60)
    reader.join(10)
    return (code, "".join(out), rest) if watch == "stdout" else (code, rest, "".join(out))


def _wait_for_library(proc: subprocess.Popen, name: str) -> None:
    """Until /proc/PID/maps shows `name`: the process is importing that package (not still starting Python,
    whose own start-up, before any of our code runs, no handler can cover)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if name in Path(f"/proc/{proc.pid}/maps").read_text():
            return
        time.sleep(0.002)
    raise AssertionError(f"{name} was never loaded")


def _assert_clean(code: int, err: str, program: str) -> None:
    assert code == 130, err
    assert "Traceback" not in err and "terminate called" not in err, err
    assert f"{program}: interrupted" in err, err


# moment: (library being loaded, then seconds) or (stdout marker): importing, loading the engine, streaming
RUN_MOMENTS = {"importing": ("onnxruntime", 0, None), "loading": ("onnxruntime", 0.3, None),
               "streaming": (None, 0, " ")}


@pytest.mark.parametrize("moment", RUN_MOMENTS)
def test_engine_run_interrupt(moment, long_engine):
    library, delay, line = RUN_MOMENTS[moment]
    proc = _start("runtime.cli", "--engine", str(long_engine), "--prompt", "def f(", "--stream", "--ignore-eos",
                  "--max-new-tokens", "4000", "--temperature", "1", "--seed", "1")
    code, out, err = _interrupt(proc, library, delay, line)
    _assert_clean(code, err, "engine-run")
    if moment == "streaming":
        assert out, "the tokens streamed before the interrupt were flushed"


def _recipe(tmp_path: Path, model: Path) -> Path:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(model), "limits": {"max_seq_len": 64}}))
    return recipe


# moment: importing torch/transformers, after the trace, writing the engine (then verification)
BUILD_MOMENTS = {"importing": ("libtorch", 0, None), "after-trace": (None, 0, "traced "),
                 "lowering": (None, 0, "pass cleanup")}


@pytest.mark.parametrize("moment", BUILD_MOMENTS)
def test_engine_build_interrupt_removes_partial_and_keeps_old_engine(moment, tiny_checkpoint, tiny_engine, tmp_path):
    import shutil

    out = tmp_path / "engines" / "tiny"
    shutil.copytree(tiny_engine, out)  # an engine built earlier: must survive the interrupted rebuild
    before = sorted(p.name for p in out.iterdir())
    library, delay, line = BUILD_MOMENTS[moment]
    proc = _start("builder.cli", "--recipe", str(_recipe(tmp_path, tiny_checkpoint)), "--out", str(out))
    code, _, err = _interrupt(proc, library, delay, line, watch="stderr")
    _assert_clean(code, err, "engine-build")
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]  # no .tiny.partial-PID left


def test_stale_partial_of_dead_build_is_removed(tmp_path):
    out = tmp_path / "engines" / "tiny"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = out.parent / f".tiny.partial-{dead.pid}"
    alive = out.parent / f".tiny.partial-{os.getpid()}"  # a running build (this process): kept
    other = out.parent / f".other.partial-{dead.pid}"  # another output's: not ours to judge here
    for folder in (stale, alive, other):
        folder.mkdir(parents=True)
        (folder / "model.onnx.data").write_bytes(b"0" * 10)
    remove_stale(out, log=lambda _: None)
    assert not stale.exists() and alive.exists() and other.exists()


def test_interrupt_during_the_final_rename_waits_until_the_engine_is_in_place(tmp_path, monkeypatch):
    import json

    from builder.output_dir import replace, start_partial

    out = tmp_path / "engine"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"format_version": 1, "builder_version": "0.1.0", "v": "old"}))
    tmp = start_partial(out)
    (tmp / "manifest.json").write_text(json.dumps({"format_version": 1, "builder_version": "0.1.0", "v": "new"}))
    seen = []
    previous = signal.signal(signal.SIGINT, lambda *_: seen.append((out / "manifest.json").is_file()
                                                                   and "new" in (out / "manifest.json").read_text()))
    rename = Path.rename

    def rename_then_interrupt(self, target):
        result = rename(self, target)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C right after the old engine moved aside
        return result

    monkeypatch.setattr(Path, "rename", rename_then_interrupt)
    try:
        replace(tmp, out)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [True]  # delivered once, after the new engine was in place
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]


def test_build_killed_during_verification_leaves_no_engine_and_the_next_build_cleans_up(tiny_checkpoint, tmp_path):
    out = tmp_path / "engines" / "tiny"
    recipe = _recipe(tmp_path, tiny_checkpoint)
    proc = _start("builder.cli", "--recipe", str(recipe), "--out", str(out), "--verify")
    partial = out.parent / f".tiny.partial-{proc.pid}"
    deadline = time.monotonic() + 120
    while not (partial / "tokenizer.json").is_file():  # copied just before verification (the manifest: once, after)
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.005)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait(30)
    assert not out.exists() and partial.is_dir()  # nothing loadable at the output path
    logs: list[str] = []
    build_engine(load_recipe(recipe, ["verify.enabled=off"]), out, log=logs.append)
    assert not partial.exists() and (out / "manifest.json").is_file()
    assert any("interrupted build" in line for line in logs)
