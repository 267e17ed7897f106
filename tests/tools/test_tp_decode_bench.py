"""tools.bench.tp_decode: one command measures a tp1 and a tp2 engine side by side (alternating rounds, each
in a fresh process) and splits every rank's decode step; its output's structure and the engines' tokens
are checked here, never its timings. Also the collective backend choice (ENGINE_TP_BACKEND) that
tools.gpu.check uses to run a tp2 engine's ranks on one GPU with gloo."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from builder.build import build_engine
from builder.recipe import load_recipe
from runtime.engine import LLM
from runtime.manifest.load import EngineError
from tools.bench.tp_decode import PARTS, main, step_split
from tools.checkpoints.make_checkpoint import make_checkpoint
from tools.gpu.steps import TINY, tp2_on_one_device


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-bench")
    checkpoint = make_checkpoint(root / "ckpt", initializer_range=0.1, seed=3)
    built = {}
    for tp in (1, 2):
        recipe = load_recipe(base={"model": str(checkpoint)}, overrides=[
            "limits.max_seq_len=64", "limits.max_batch_size=1", "verify.enabled=off", f"parallel.tensor_parallel={tp}"])
        built[tp] = str(build_engine(recipe, root / f"tp{tp}", log=lambda _: None))
    return built


def test_side_by_side_rounds_alternate_and_split_every_rank(engines):
    result = CliRunner().invoke(main, [
        "--engine", engines[1], "--threads", "1", "--engine", engines[2], "--threads", "1",
        "--runs", "2", "--new-tokens", "5", "--prompt-tokens", "6"])
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["order"] == [engines[1], engines[2], engines[2], engines[1]]  # A B B A
    assert [(r["round"], r["slot"]) for r in report["rounds"]] == [(1, 0), (1, 1), (2, 1), (2, 0)]
    assert report["tokens_agree"] and len(report["rounds"][0]["tokens"]) == 5
    one, two = report["engines"]
    assert (one["tensor_parallel"], two["tensor_parallel"]) == (1, 2) and one["ranks"] == []
    for summary in (one, two):
        rate = summary["decode_tok_s"]
        assert 0 < rate["min"] <= rate["median"] <= rate["max"] and len(summary["round_medians"]) == 2
    assert [r["rank"] for r in two["ranks"]] == [0, 1] and two["peak_rss_mb_other_ranks"] > 0
    assert one["peak_rss_mb_other_ranks"] is None and one["peak_rss_mb_rank0"] > 0
    for rank in report["rounds"][1]["ranks"]:
        assert rank["decode_steps"] == 2 * 3  # 2 runs x (5 tokens - the prefill's - the last decode step)
        ms = rank["ms"]
        assert ms["all_reduce"] == pytest.approx(ms["wait"] + ms["gloo"], abs=2e-3)
        assert ms["step"] == pytest.approx(ms["compute"] + ms["all_reduce"], abs=2e-3)
        assert ms["interval"] >= ms["step"] and set(rank["share"]) == {"all_reduce", *PARTS}
    assert "tok/s median" in result.stderr and "gloo %" in result.stderr  # the table


def test_one_engine_in_this_process_keeps_its_output(engines):
    result = CliRunner().invoke(main, ["--engine", engines[2], "--threads", "1", "--runs", "1",
                                                       "--new-tokens", "4"])
    assert result.exit_code == 0, result.output + result.stderr
    out = json.loads(result.stdout)
    assert out["tensor_parallel"] == 2 and out["threads_per_rank"] == 1 and len(out["runs"]) == 1
    assert {"decode_tok_s", "all_reduce_share", "ranks", "tokens", "load_s"} <= set(out)
    assert out["peak_rss_mb_other_ranks"] > 0  # rank 1, a child of this process
    assert [r["decode_steps"] for r in out["ranks"]] == [2, 2]


def test_threads_must_pair_with_engines(engines):
    result = CliRunner().invoke(main, ["--engine", engines[1], "--engine", engines[2], "--threads", "1",
                                       "--threads", "2", "--threads", "1"])
    assert result.exit_code != 0 and "3 values for 2 engines" in result.output


def test_step_split_tells_waiting_from_the_collective():
    """Two ranks, one collective per step: rank 1 arrives 3 ms after rank 0, both leave 1 ms later."""
    def step(t, enter, leave, end, tokens=1):  # [tokens, start, enter, exit, end] in seconds
        return [tokens, t, t + enter, t + leave, t + end]

    rank0 = [step(-0.1, 0.01, 0.02, 0.03, tokens=16)] + [step(t, 0.002, 0.006, 0.008) for t in (0.0, 0.010, 0.020)]
    rank1 = [step(-0.1, 0.01, 0.02, 0.02, tokens=16)] + [step(t + 0.001, 0.004, 0.005, 0.005)
                                                         for t in (0.0, 0.010, 0.020)]
    r0, r1 = step_split([rank0, rank1], [range(4)])  # the prefill and the last step (no interval) are left out
    assert r0["ms"]["wait"] == pytest.approx(3.0) and r0["ms"]["gloo"] == pytest.approx(1.0)
    assert r1["ms"]["wait"] == pytest.approx(0.0) and r1["ms"]["gloo"] == pytest.approx(1.0)
    assert r0["ms"]["compute"] == pytest.approx(4.0) and r1["ms"]["compute"] == pytest.approx(4.0)
    assert r0["ms"]["outside"] == pytest.approx(2.0) and r1["ms"]["outside"] == pytest.approx(5.0)
    assert r0["share"]["all_reduce"] == pytest.approx(0.4) and r0["decode_steps"] == 2


def test_gpu_checks_tp2_on_one_device_runs_on_cpu(tmp_path):
    """tools.gpu.check's tp2-ranks-on-one-GPU check (ENGINE_TP_BACKEND=gloo, greedy identical to tp1), on CPU, in
    float16 as on a GPU: a float16 tp engine's last segment declares the sampling head's float32 outputs
    (its rank 0 failed to load with float16 topk_values before)."""
    checkpoint = make_checkpoint(tmp_path / "ckpt", **TINY, initializer_range=0.1, seed=3)
    ragged = [[3 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate((11, 3, 17, 6))]
    assert tp2_on_one_device(checkpoint, tmp_path, "cpu", "float16", ragged) == "identical"


@pytest.mark.parametrize("value, message", [("mpi", "backends are 'gloo' and 'nccl'"),
                                            ("nccl", "needs a cuda engine and torch with CUDA")])
def test_a_backend_that_cannot_run_is_refused_before_workers_start(engines, monkeypatch, value, message):
    monkeypatch.setenv("ENGINE_TP_BACKEND", value)
    with pytest.raises(EngineError, match=message):
        LLM(engines[2])
