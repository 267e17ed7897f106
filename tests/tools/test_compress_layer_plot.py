"""tools.compress.layer_plot with --keep-heads: the KV groups' activation importance beside the measured cost of
silencing each, on the trained 3M target; a head count that is not whole KV groups is refused before any work."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from tools.compress import layer_plot

TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target"
ARGS = ["--teacher", str(TARGET), "--keep", "2", "--windows", "2", "--seq-len", "32"]


def test_heads_are_scored_measured_and_compared(tmp_path):
    result = CliRunner().invoke(layer_plot.main, ARGS + ["--keep-heads", "3", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    found = json.loads((tmp_path / "layers.json").read_text())
    layers, groups = 4, 2  # the target: 4 layers, 6 heads in 2 KV groups
    assert [len(row) for row in found["head_group_loss_increase"]] == [groups] * layers
    assert all(len(kept) == 1 for kept in found["kept_by_importance"] + found["kept_by_cost"])
    for kept, cost in zip(found["kept_by_cost"], found["head_group_loss_increase"]):
        assert cost[kept[0]] == max(cost)  # the group kept by cost is the one whose silencing costs most
    agree = sum(a == b for a, b in zip(found["kept_by_importance"], found["kept_by_cost"])) / layers
    assert found["layers_agreeing"] == agree
    assert (tmp_path / "heads.png").is_file() and (tmp_path / "layers.png").is_file()


def test_heads_not_in_whole_kv_groups_are_refused_before_any_work(tmp_path):
    result = CliRunner().invoke(layer_plot.main, ARGS + ["--keep-heads", "4", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "whole KV groups of 3" in result.output
    assert not (tmp_path / "x").exists()
