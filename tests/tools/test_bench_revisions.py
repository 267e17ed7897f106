"""tools/bench/revisions: one engine measured under two revisions of the runtime, each in its own process
that imports only that revision's runtime (a smoke test, not a timed one), and the env/stats helpers
every benchmark in tools/bench/ shares."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import env, revisions
from tools.bench.stats import median_of_runs, spread

ROOT = Path(__file__).resolve().parents[2]


def test_a_round_imports_the_revisions_own_runtime(tiny_engine, tmp_path):
    # a copy of this tree's runtime that imports a marker module: the round must import that copy, not this tree's
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "runtime", copy / "runtime")
    (copy / "runtime" / "marker.py").write_text("")
    (copy / "runtime" / "engine.py").write_text((ROOT / "runtime" / "engine.py").read_text() + "\nimport runtime.marker\n")
    args = {"engine": str(tiny_engine), "batch_sizes": [1, 2], "prompt_len": 4, "new_tokens": 3, "runs": 1,
            "threads": 1, "seed": 0}
    rates = revisions.run_round(copy, args)
    assert set(rates) == {"1", "2"} and all(len(v) == 1 and v[0] > 0 for v in rates.values())
    (copy / "runtime" / "marker.py").write_text("raise ImportError('the copy was imported')")
    with pytest.raises(RuntimeError, match="the copy was imported"):
        revisions.run_round(copy, args)


def test_a_round_can_take_another_kv_backend(tiny_engine):
    """--new-kv-backend: one revision against itself on another KV cache backend (what tools/bench/kv_backend did)."""
    args = {"engine": str(tiny_engine), "batch_sizes": [1], "prompt_len": 4, "new_tokens": 3, "runs": 1,
            "threads": 1, "seed": 0, "kv_backend": "ortvalue"}
    rates = revisions.run_round(ROOT, args)
    assert len(rates["1"]) == 1 and rates["1"][0] > 0
    with pytest.raises(RuntimeError, match="backend"):
        revisions.run_round(ROOT, args | {"kv_backend": "no-such-backend"})


def test_revision_tree_takes_a_directory_as_it_is(tmp_path):
    assert revisions.revision_tree(str(tmp_path), ROOT, tmp_path / "scratch") == tmp_path.resolve()


def test_shared_helpers():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert median_of_runs([{"a": 1, "b": {"c": 4}}, {"a": 3, "b": {"c": 2}}]) == {"a": 2, "b": {"c": 3}, "runs": 2}
    described = env.environment()
    assert set(described) == {"date", "machine", "versions", "load_average"}
    assert "cores usable" in described["machine"] and described["versions"]["numpy"]
    assert env.cpu_vector_flags() in ("AVX-512", "AVX2", "")


def test_the_command_reports_rounds_paired_back_to_back(tiny_engine):
    # the same tree as both revisions: every paired ratio compares two fresh processes of identical code
    cmd = [sys.executable, "-m", "tools.bench.revisions", "--engine", str(tiny_engine), "--old", str(ROOT),
           "--new", str(ROOT), "--batch-sizes", "1", "--rounds", "2", "--runs", "1", "--prompt-len", "4",
           "--new-tokens", "3", "--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "paired rounds" in out
    row = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    paired = float(cells[4].split()[0])
    assert paired > 0 and len(cells) == 5
