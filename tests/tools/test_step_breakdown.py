"""tools/bench/step_breakdown: the per-step breakdown runs on a real engine, its phases add up to the step,
the engine's work shows up where it happens, and measuring leaves the executor and runner as they were
(a smoke test, not a timed one)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from runtime.engine import LLM
from runtime.request.params import SamplingParams
from tools.bench import step_breakdown as sb


@pytest.fixture(scope="module")
def llm(tiny_engine):
    engine = LLM(tiny_engine, threads=1)
    yield engine
    engine.close()


def _adds_up(phases: dict[str, float]) -> None:
    assert set(phases) == {*sb.PHASES, "step"}
    assert sum(phases[p] for p in sb.PHASES) == pytest.approx(phases["step"], rel=1e-9, abs=1e-12)
    named = phases["step"] - phases["other"]
    assert phases["ort"] > 0 and named > 0.5 * phases["step"]  # most of the step is attributed


def test_inflight_phases_add_up_to_the_step(llm):
    for batch in (1, 3):
        phases = sb.inflight_breakdown(llm, batch, [5, 6, 7, 8], tokens=6)
        _adds_up(phases)
        assert phases["schedule"] > 0 and phases["prepare"] > 0 and phases["postprocess"] > 0
        assert phases["detokenize"] > 0 and phases["handoff"] > 0


def test_static_phases_add_up_and_have_no_executor_work(llm):
    phases = sb.static_breakdown(llm, 2, [5, 6, 7, 8], tokens=6)
    _adds_up(phases)
    assert phases["schedule"] == phases["postprocess"] == phases["detokenize"] == phases["handoff"] == 0
    assert phases["head"] > 0  # the argmax over the full logits on the host


def test_only_decode_steps_are_counted(llm):
    """A step that runs a prompt chunk is left out: 6 new tokens = 1 prefill step + 5 decode steps."""
    phases = sb.Phases()
    sb.inflight_breakdown(llm, 1, [5, 6, 7, 8], tokens=6, phases=phases)
    assert len(phases.steps) == 5


def test_measuring_leaves_the_objects_as_they_were(llm):
    executor, session = llm.executor, llm.runner.session
    sb.inflight_breakdown(llm, 1, [5, 6, 7], tokens=4)
    assert llm.runner.session is session and "_plan" not in vars(executor) and "_run" not in vars(executor)
    params = SamplingParams(max_new_tokens=5)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == llm.generate([[5, 6, 7]], params)[0].token_ids


def test_the_command_prints_both_modes_and_the_ratio(tiny_engine, tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(sb.main_command(), [str(tiny_engine), "--batch-sizes", "1,2", "--tokens", "4",
                                                    "--runs", "1", "--threads", "1", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    assert "| 1 | in-flight |" in result.output and "| 2 | static |" in result.output
    assert "executor" in result.output and "raw runner" in result.output and "caller wake" in result.output
    assert "CPU time, one thread" in result.output  # --threads 1
    assert "executor host work per decode step" in result.output
    assert out.read_text().count('"ratio"') == 2


def test_host_work_grows_with_the_batch(llm):
    one, many = sb.host_work(llm.tokenizer, 1, steps=50, runs=2), sb.host_work(llm.tokenizer, 8, steps=50, runs=2)
    assert 0 < one < many


def test_one_client_pairs_in_flight_and_static_tpot_round_by_round(llm):
    out = sb.one_client(llm, rounds=2, requests=2, prompts="uniform:4:8", outputs="uniform:3:6")
    assert len(out["in-flight_ms"]) == len(out["static_ms"]) == len(out["ratio"]) == 2
    assert all(x > 0 for x in out["in-flight_ms"] + out["static_ms"])
    assert out["ratio"] == pytest.approx([a / b for a, b in zip(out["in-flight_ms"], out["static_ms"])])
    assert min(out["ratio"]) <= out["median_ratio"] <= max(out["ratio"])


def test_many_clients_pairs_the_three_modes_round_by_round(tiny_engine):
    llm = LLM(tiny_engine, threads=1, max_batch_size=4)
    try:
        out = sb.many_clients(llm, clients=4, rounds=2, per_client=2, single=2, prompts="uniform:4:8",
                              outputs="uniform:3:6")
    finally:
        llm.close()
    assert len(out["throughput_ratio"]) == len(out["tpot_ratio"]) == 2
    assert out["throughput_ratio"] == pytest.approx([a / b for a, b in zip(out["in-flight_tok_s"], out["static_tok_s"])])
    assert out["tpot_ratio"] == pytest.approx([a / b for a, b in zip(out["tpot_ms"], out["single_tpot_ms"])])
    assert min(out["tpot_ratio"]) <= out["median_tpot_ratio"] <= max(out["tpot_ratio"])


def test_overlap_modes_time_three_modes_with_the_same_tokens(tiny_engine):
    out = sb.overlap_modes(tiny_engine, 2, 6, 1, threads=1)
    assert out["same_tokens"] and out["steps_run_ahead"] > 0
    for mode in sb.OVERLAP_MODES:
        assert out[f"executor_ms_{mode}"] > 0 and out[f"runner_ms_{mode}"] > 0
        assert out[f"ratio_{mode}"] == pytest.approx(out[f"executor_ms_{mode}"] / out[f"runner_ms_{mode}"], rel=1)


def test_engine_bench_turns_compaction_off_by_flag(tiny_engine):
    """engine-bench --compaction off (ExecutorConfig.compaction, no patched scheduler): the same requests are served
    in full and no sequence moves; on, short requests finish low and long ones move down (tokens unchanged by a
    move: tests/runtime/test_kv_blocks.py)."""
    from runtime.engine import LLM
    from tools.engine_bench import workloads as wl
    from tools.engine_bench.config import BenchConfig
    from tools.engine_bench.drivers import inflight

    assert BenchConfig(engine=tiny_engine, compaction=False).executor_config().compaction is False
    # one burst (open loop, every arrival 0: queued together), the long one last, so it takes the top row and
    # the three short ones leave the rows below it empty (a closed loop's clients raced the steps: flaky)
    shapes = [wl.Shape(6, n) for n in (6, 8, 10, 40)]
    llm = LLM(tiny_engine, max_batch_size=4)
    try:
        reqs = wl.materialize(shapes, llm.manifest.vocab_size, [0, 1])
        on, off = (inflight(llm, reqs, None, compaction=flag) for flag in (True, False))
    finally:
        llm.close()
    assert off.breakdown["moved_sequences"] == 0 < on.breakdown["moved_sequences"]
    assert sorted(s.output_tokens for s in on.served) == sorted(s.output_tokens for s in off.served)
