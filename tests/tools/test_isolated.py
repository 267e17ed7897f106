"""tools/bench/isolated: benchmark work in its own process, with errors and deaths reported to the caller."""
from __future__ import annotations

import collections
import math
import os

import pytest

from tools.bench import isolated


def test_worker_runs_methods_in_another_process():
    worker = isolated.Worker(collections.Counter, "abracadabra")
    try:
        assert worker.call("most_common", 1) == [("a", 5)]
        worker.call("update", "zzzzzz")
        assert worker.call("most_common", 1) == [("z", 6)]  # state lives in the child between calls
    finally:
        worker.close()


def test_errors_carry_the_child_traceback():
    with pytest.raises(isolated.WorkerError, match="ValueError: invalid literal"):
        isolated.Worker(int, "not a number")
    worker = isolated.Worker(collections.Counter, "ab")
    try:
        with pytest.raises(isolated.WorkerError, match="AttributeError"):
            worker.call("no_such_method")
        assert worker.call("total") == 2  # the worker survives a failed call
    finally:
        worker.close()


def test_run_reports_time_and_memory():
    result, stats = isolated.run(math.factorial, 20, preload=("json",))
    assert result == math.factorial(20)
    assert stats["seconds"] >= 0 and stats["peak_rss_mb"] >= stats["start_rss_mb"] > 0
    assert isolated.run(os.getpid)[0] != os.getpid()


def test_peak_memory_is_the_childs_own_not_its_parents():
    """A parent holding 400 MB spawns the child: the child's peak must not include them (ru_maxrss would)."""
    import numpy as np

    held = np.ones(400 * 2**20 // 8)
    _, stats = isolated.run(math.factorial, 5)
    assert held.sum() > 0 and stats["peak_rss_mb"] < 300


def test_a_dying_child_is_an_error_not_a_hang():
    with pytest.raises(isolated.WorkerError, match="exited \\(code 3\\)"):
        isolated.run(os._exit, 3)
