"""tools.compress.recovery (the half-depth recovery curve of docs/ACCURACY.md): a time budget ends each run, and
the report puts the methods side by side at equal tokens and at equal wall time, with where each closes half of
the log-perplexity gap. On the trained 3M target, a few steps."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from tools.compress import recovery

TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target"


def _history(*points):
    return [{"tokens": t, "seconds": s, "heldout_ppl": p} for t, s, p in points]


def test_interpolation_is_linear_in_log_perplexity_and_none_outside_the_curve():
    history = _history((0, 0.0, 100.0), (100, 10.0, 10.0), (200, 30.0, 1.0))
    assert recovery.at(history, "tokens", 50) == pytest.approx(math.sqrt(100 * 10))
    assert recovery.at(history, "seconds", 20.0) == pytest.approx(math.sqrt(10 * 1))
    assert recovery.at(history, "tokens", 200) == pytest.approx(1.0)
    assert recovery.at(history, "tokens", 201) is None


def test_half_the_gap_is_where_log_perplexity_is_halfway_to_the_teacher():
    untrained, teacher = 100.0, 1.0  # half the gap in log-perplexity: 10
    history = _history((0, 0.0, 100.0), (100, 10.0, 31.6227766), (200, 30.0, 3.16227766))
    assert recovery.crossing(history, "tokens", 0.5, untrained, teacher) == pytest.approx(150)
    assert recovery.crossing(history, "seconds", 0.5, untrained, teacher) == pytest.approx(20.0)
    assert recovery.crossing(history[:2], "tokens", 0.5, untrained, teacher) is None


def test_a_time_budget_ends_both_runs_and_the_report_compares_them(tmp_path):
    out = tmp_path / "rec"
    args = ["--teacher", str(TARGET), "--layers", "2", "--methods", "kd,ce", "--steps", "6", "--batch-size", "2",
            "--seq-len", "16", "--eval-every", "3", "--files-every", "400", "--heldout-windows", "2",
            "--max-minutes", "1e-9", "--out", str(out)]
    result = CliRunner().invoke(recovery.main, args)
    assert result.exit_code == 0, result.output
    for method in ("kd", "ce"):
        history = json.loads((out / method / "compress.json").read_text())["history"]
        assert [h["step"] for h in history] == [0, 1]  # the budget is spent after the first step
    result = CliRunner().invoke(recovery.main, ["--out", str(out), "--report"])
    assert result.exit_code == 0, result.output
    report = (out / "report.md").read_text()
    assert "At equal training tokens" in report and "At equal wall seconds (contended)" in report
    assert "| tokens | ce: ppl | ce: gap | kd: ppl | kd: gap |" in report  # the runs' folders, sorted
    assert "At equal the run's CPU seconds" in report
    assert report.count("half of the gap") == 2 and (out / "recovery.png").is_file()
