"""engine-compress --eagle --init-head DIR: training continues from a saved head (its weights and draft vocabulary),
checked against the target before any work; the continued head's record says where it started and keeps the
earlier run's report; a resumed continuation takes its own state's weights, not the init head's again."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from test_compress import TARGET, _interrupt_at

import builder.compress.cli as cli
from builder.compress.cli import TextSpec, compress_eagle
from builder.compress.distill import DistillConfig, Interrupted
from builder.compress.eagle import HEAD_FILE, WEIGHTS_FILE, EagleConfig
from builder.compress.plan import CompressError
from tools.corpus import training_files

FIGURES = ("accept_1", "accept_2", "accept_3", "accepted_length_3", "heldout_kl")


def _spec() -> TextSpec:
    return TextSpec(tuple(str(p) for p in training_files()[201:203]), seq_len=32, heldout_windows=4)


def _cfg(steps: int) -> DistillConfig:
    return DistillConfig(steps=steps, batch_size=4, lr=3e-3, warmup=1, eval_every=2, save_every=100)


def _record(head: Path) -> dict:
    return json.loads((head / HEAD_FILE).read_text())


def _weights(head: Path) -> dict[str, torch.Tensor]:
    return load_file(str(head / WEIGHTS_FILE))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return compress_eagle(TARGET, tmp_path_factory.mktemp("first") / "head", _cfg(4), EagleConfig(), _spec())


@pytest.fixture(scope="module")
def continued(saved, tmp_path_factory) -> Path:
    return compress_eagle(TARGET, tmp_path_factory.mktemp("next") / "head", _cfg(4), EagleConfig(), _spec(),
                          init_head=saved)


@pytest.mark.e2e
def test_zero_steps_from_a_saved_head_write_it_back_unchanged(saved, tmp_path):
    again = compress_eagle(TARGET, tmp_path / "head", _cfg(0), EagleConfig(), _spec(), init_head=saved)
    before, after = _weights(saved), _weights(again)
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    record, first = _record(again), _record(saved)
    for figure in FIGURES:  # scored as the saved head's final evaluation, on the same held-out windows
        assert record["history"][0][figure] == pytest.approx(first["heldout"][figure], rel=1e-6, abs=1e-9)


@pytest.mark.e2e
def test_continued_training_starts_where_the_saved_head_ended_and_records_it(saved, continued):
    first, record = _record(saved), _record(continued)
    start = record["history"][0]  # step 0 of the continuation: the saved head's weights, before any step
    for figure in FIGURES:
        assert start[figure] == pytest.approx(first["heldout"][figure], rel=1e-6, abs=1e-9)
    assert start["heldout_kl"] < first["history"][0]["heldout_kl"]  # not a new head: the trained one
    assert record["heldout"]["heldout_kl"] < start["heldout_kl"]  # and it goes on learning
    assert not torch.equal(_weights(saved)["fc.weight"], _weights(continued)["fc.weight"])
    assert torch.equal(_weights(saved)["draft_ids"], _weights(continued)["draft_ids"])  # its vocabulary kept
    assert record["continued_from"] == str(saved) and record["steps_before"] == 4 and record["steps_total"] == 8
    (earlier,) = record["earlier_runs"]
    assert earlier["head"] == str(saved) and earlier["history"] == first["history"]
    assert earlier["distill"] == first["distill"] and earlier["heldout"] == first["heldout"]
    assert first["steps_total"] == 4 and "continued_from" not in first


@pytest.mark.e2e
def test_a_resumed_continuation_keeps_its_own_state_not_the_init_head(saved, continued, tmp_path):
    out = tmp_path / "head"
    with pytest.raises(Interrupted, match="after step 2"):
        compress_eagle(TARGET, out, _cfg(4), EagleConfig(), _spec(), on_step=_interrupt_at(2), init_head=saved)
    with pytest.raises(CompressError, match=f"started from {saved.resolve()}, this run from new weights"):
        compress_eagle(TARGET, out, _cfg(4), EagleConfig(), _spec())  # the state is not a new head's
    compress_eagle(TARGET, out, _cfg(4), EagleConfig(), _spec(), init_head=saved)
    whole = _weights(continued)
    for name, value in _weights(out).items():  # as the uninterrupted continuation: steps 1-2 were not undone
        assert torch.equal(value, whole[name]), name
    assert _record(out)["steps_total"] == 8


def test_a_head_for_another_target_is_refused_before_any_work(tmp_path, monkeypatch):
    other = tmp_path / "other"  # what a head of a 576-wide target records (its weights are not read)
    other.mkdir()
    (other / HEAD_FILE).write_text(json.dumps({"kind": "eagle", "hidden_size": 576, "num_layers": 30}))
    (other / WEIGHTS_FILE).write_bytes(b"")
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the target was loaded before the check"))
    with pytest.raises(CompressError, match=r"--init-head .*other: the head was trained for another target: its "
                                            r"hidden_size is 576, this target's 192; --init-head takes a head trained "
                                            r"for this target \(the same hidden size, layers, vocabulary and tokenizer\)"):
        compress_eagle(TARGET, tmp_path / "out", _cfg(2), EagleConfig(), _spec(), init_head=other)
    with pytest.raises(CompressError, match="not an EAGLE head folder"):
        compress_eagle(TARGET, tmp_path / "out", _cfg(2), EagleConfig(), _spec(), init_head=TARGET)
    assert not (tmp_path / "out").exists()


def test_init_head_without_eagle_is_refused(tmp_path):
    result = CliRunner().invoke(cli.main, [str(TARGET), "--out", str(tmp_path / "out"), "--text", str(TARGET),
                                           "--layers", "2", "--init-head", str(tmp_path / "head")])
    assert result.exit_code != 0 and "--init-head continues an EAGLE head: give --eagle too" in result.output
