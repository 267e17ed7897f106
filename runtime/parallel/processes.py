"""The worker processes of a multi-process engine (tensor-parallel ranks, pipeline stages): started as `python -m
MODULE` (not multiprocessing: a user's script without a __main__ guard is not re-imported), waited for until each
has loaded, and ended. Both runners (runtime/parallel/runner.py, pipeline_runner.py) use these."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


def spawn(module: str, engine_dir: Path, indices: range, world: int, port: int, spec, config) -> list[subprocess.Popen]:
    """One `python -m module ENGINE INDEX WORLD PORT SPEC CONFIG` process per index (a rank, or a stage)."""
    return [subprocess.Popen([sys.executable, "-m", module, str(engine_dir), str(index), str(world), str(port),
                              json.dumps(spec.to_dict()), config.to_json()]) for index in indices]


def wait_loaded(store, workers: list[subprocess.Popen], keys: list[str],
                failed: Callable[[int, int], Exception]) -> None:
    """Wait until worker i has set `keys[i]` in the store; if one exits first, end them all and raise
    `failed(i, its exit code)`."""
    waiting = dict(enumerate(keys))
    while waiting:
        for i, key in list(waiting.items()):
            if store.check([key]):
                del waiting[i]
            elif workers[i].poll() is not None:
                end(workers, broken=True)
                raise failed(i, workers[i].returncode)
        time.sleep(0.02)


def exited(process: subprocess.Popen, seconds: float) -> int | None:
    """The process's exit code once it ends within `seconds`, else None."""
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def end(workers: list[subprocess.Popen], broken: bool) -> None:
    """Let each worker finish (a broken engine's get no time to finish a step), then terminate, then kill."""
    grace = 0.5 if broken else 5.0
    for process in workers:
        if exited(process, grace) is None:
            process.terminate()
            if exited(process, grace) is None:
                process.kill()
                process.wait()


def describe(tp: int, rank: int) -> str:
    """A stage process as errors name it: "pipeline stage 1 (rank 2)", or with tensor parallelism
    "pipeline stage 1, tp rank 0 (rank 3)"."""
    stage, tp_rank = divmod(rank - 1, tp)
    return f"pipeline stage {stage}{f', tp rank {tp_rank}' if tp > 1 else ''} (rank {rank})"
