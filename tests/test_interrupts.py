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
from tools.make_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
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


def _interrupt(proc: subprocess.Popen, after_s: float | None, after_line: str | None) -> tuple[int, str, str]:
    """SIGINT `after_s` seconds from start, or once a stdout line contains `after_line`; (code, out, err)."""
    out: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for raw in iter(lambda: proc.stdout.read1(4096) if hasattr(proc.stdout, "read1") else b"", b""):
            out.append(raw.decode(errors="replace"))
            if after_line is None or after_line in "".join(out):
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if after_line is not None:
        assert seen.wait(60), f"never saw {after_line!r}: {''.join(out)!r}"
    else:
        time.sleep(after_s)
    assert proc.poll() is None, "the process ended before the interrupt; the test moment is too late"
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read().decode(errors="replace")
    code = proc.wait(60)
    reader.join(10)
    return code, "".join(out), err


def _assert_clean(code: int, err: str, program: str) -> None:
    assert code == 130, err
    assert "Traceback" not in err and "terminate called" not in err, err
    assert f"{program}: interrupted" in err, err


# moment: (seconds after start, or a stdout marker) -- importing, loading the engine, streaming tokens
RUN_MOMENTS = {"importing": (0.15, None), "loading": (0.6, None), "streaming": (None, " ")}


@pytest.mark.parametrize("moment", RUN_MOMENTS)
def test_engine_run_interrupt(moment, long_engine):
    after_s, after_line = RUN_MOMENTS[moment]
    proc = _start("runtime.cli", "--engine", str(long_engine), "--prompt", "def f(", "--stream", "--ignore-eos",
                  "--max-new-tokens", "4000", "--temperature", "1", "--seed", "1")
    code, out, err = _interrupt(proc, after_s, after_line)
    _assert_clean(code, err, "engine-run")
    if moment == "streaming":
        assert out, "the tokens streamed before the interrupt were flushed"


def _recipe(tmp_path: Path, model: Path) -> Path:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(model), "limits": {"max_seq_len": 64}}))
    return recipe


# moment: importing torch/transformers, after the trace, writing the engine (then verification)
BUILD_MOMENTS = {"importing": (0.3, None), "after-trace": (None, "traced "), "lowering": (None, "pass cleanup")}


@pytest.mark.parametrize("moment", BUILD_MOMENTS)
def test_engine_build_interrupt_removes_partial_and_keeps_old_engine(moment, tiny_checkpoint, tiny_engine, tmp_path):
    import shutil

    out = tmp_path / "engines" / "tiny"
    shutil.copytree(tiny_engine, out)  # an engine built earlier: must survive the interrupted rebuild
    before = sorted(p.name for p in out.iterdir())
    after_s, after_line = BUILD_MOMENTS[moment]
    proc = _start("builder.cli", "--recipe", str(_recipe(tmp_path, tiny_checkpoint)), "--out", str(out))
    code, _, err = _interrupt(proc, after_s, after_line)
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
