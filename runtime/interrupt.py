"""Ctrl-C for the command-line tools: stop at once and cleanly, at whatever moment it arrives.

Letting SIGINT raise KeyboardInterrupt is not robust here: arriving inside an import (transformers'
lazy modules re-raise it as an ImportError/RuntimeError) it becomes a traceback, and when the executor's
daemon thread is inside an ONNX Runtime call as the interpreter finalizes, the process aborts with
"terminate called without an active exception" (exit 134). So while a CLI runs, SIGINT runs the
tool's cleanups (flush partial output, remove a partial engine folder), prints one line and leaves with
os._exit(130): no interpreter finalization, so no destructor of a running ONNX Runtime call is reached.
The handler runs in the main thread between bytecodes, so a cleanup sees consistent Python state."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

INTERRUPTED_EXIT = 130  # 128 + SIGINT, what shells report for a process stopped by Ctrl-C


@contextlib.contextmanager
def exit_on_interrupt(program: str) -> Iterator[list[Callable[[], None]]]:
    """Within the block, SIGINT runs the callables appended to the yielded list (last first), then
    exits 130 with "<program>: interrupted" on stderr. The previous handler is restored afterwards."""
    cleanups: list[Callable[[], None]] = []
    if threading.current_thread() is not threading.main_thread():
        yield cleanups  # signal handlers can only be set from the main thread; keep Python's default
        return

    def handler(signum, frame) -> None:
        for cleanup in reversed(cleanups):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - a failing cleanup must not stop the exit
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - e.g. a reentrant write interrupted mid-call
                pass
        os.write(2, f"\n{program}: interrupted\n".encode())
        os._exit(INTERRUPTED_EXIT)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield cleanups
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block ends, then deliver it to whatever handler was in place (used around the
    two renames that swap an engine into place). Blocking the signal mask would not do: another thread
    with SIGINT unblocked would take the signal and Python would still run the handler mid-block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            signal.raise_signal(signal.SIGINT)
