"""Run benchmark work in its own Python process.

Backends measured side by side in one process share more than the CPU: torch's OpenMP pool and ONNX
Runtime's spinning intra-op threads, the allocator and every imported native library. The decode
benchmark once measured the engine ~20% slower inside such a shared process than alone. A `Worker`
owns one object (a backend) in a freshly spawned interpreter and runs its methods over a pipe, so each
process holds one backend's threads while the caller still interleaves backends run by run. `run`
does a one-shot job the same way and also reports the child's memory (a build's peak RSS)."""
from __future__ import annotations

import importlib
import multiprocessing as mp
import resource
import time
import traceback
from typing import Any, Callable


class WorkerError(RuntimeError):
    """The work raised in the child process (the message carries its traceback) or the child died."""


class Worker:
    """`factory(*args)` constructed in a spawned process; `call(name, *args)` runs one of its methods there."""

    def __init__(self, factory: Callable[..., Any], *args: Any):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, factory, args), daemon=True)
        self._proc.start()
        child.close()
        try:
            self._reply()  # the object exists in the child, or its constructor's error is raised here
        except BaseException:
            self.close()
            raise

    def call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        return self._reply()

    def _reply(self) -> Any:
        try:
            ok, value = self._conn.recv()
        except EOFError:
            self._proc.join(timeout=5)
            raise WorkerError(f"the worker process exited (code {self._proc.exitcode})") from None
        if not ok:
            raise WorkerError(value)
        return value

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def _serve(conn, factory: Callable[..., Any], args: tuple) -> None:
    try:
        obj = factory(*args)
    except BaseException:
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, None))
    while (message := conn.recv()) is not None:
        method, margs = message
        try:
            conn.send((True, getattr(obj, method)(*margs)))
        except Exception:
            conn.send((False, traceback.format_exc()))
    close = getattr(obj, "close", None)
    if close is not None:
        close()


def run(fn: Callable[..., Any], *args: Any, preload: tuple[str, ...] = ()) -> tuple[Any, dict]:
    """`fn(*args)` in a spawned process that first imports the modules in `preload`. Returns fn's
    result and {"seconds", "peak_rss_mb", "start_rss_mb"}: wall time of the call, the child's peak
    resident memory over its whole life, and its resident memory just before the call (the
    interpreter and the preloaded libraries)."""
    worker = Worker(_Job, fn, preload)
    try:
        return worker.call("run", *args)
    finally:
        worker.close()


class _Job:
    def __init__(self, fn: Callable[..., Any], preload: tuple[str, ...]):
        self.fn = fn
        for name in preload:
            importlib.import_module(name)

    def run(self, *args: Any) -> tuple[Any, dict]:
        start_rss, t = _rss_mb(), time.perf_counter()
        result = self.fn(*args)
        seconds = time.perf_counter() - t
        return result, {"seconds": seconds, "peak_rss_mb": _peak_rss_mb(), "start_rss_mb": start_rss}


def _peak_rss_mb() -> float:
    """This process's own peak resident memory (VmHWM). Not getrusage's ru_maxrss: Linux carries that across
    exec, so a spawned child reports at least its parent's resident memory at the fork (measured: a child of
    a 1 GB parent read 982 MB, VmHWM 28 MB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
