"""Pipeline x tensor parallelism (CPU, gloo): a tiny random 4-layer Llama built with pipeline_parallel 2 and
tensor_parallel 2 runs as four stage processes (two stages, each a tensor-parallel group of two) and generates
what pp1 and transformers generate, in flight (requests joining a running batch, chunked prefill, preemption);
logits match transformers; the manifest says which process holds which layers and heads; an int8 build gives
the tokens of the same shards without stages; a process killed mid-generation stops the engine with an error
naming its stage and tp rank and leaves nothing running; splits that do not fit are refused before any work.
Qwen3, Gemma 3 and Qwen3-MoE at pp2 x tp2: tests/builder/test_pipeline_stages.py."""
from __future__ import annotations

import signal

import numpy as np
import pytest

import runtime.parallel.pipeline_runner as pipeline_runner
from builder.engine_dir import BuildError
from builder.pass_manager import PassError
from runtime.engine import LLM
from runtime.manifest.load import read_manifest
from runtime.request.params import SamplingParams
from tests.runtime import parallel_helpers
# the pipeline tests' checkpoint (4 layers, 4 query heads over 2 KV heads, intermediate 128: each splits 2 ways)
from tests.runtime.test_pipeline_parallel import build, checkpoint, in_flight, prompts, reference  # noqa: F401 (fixtures)

LOGIT_TOL = 1e-4  # float32 shards vs float32 transformers (logits ~ O(1))
PP_TP = ("parallel.pipeline_parallel=2", "parallel.tensor_parallel=2")


@pytest.fixture(scope="module")
def engines(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("pptp-engines")
    return {1: build(checkpoint, root / "pp1"), (2, 2): build(checkpoint, root / "pp2tp2", *PP_TP)}


def test_manifest_says_which_process_holds_what(engines):
    manifest = read_manifest(engines[(2, 2)])
    section = manifest.pipeline_parallel
    assert (section.size, section.tensor_parallel, section.world) == (2, 2, 5)
    assert manifest.kv_cache.kv_heads == 1  # each process's KV: its own heads (2 KV heads over 2 ranks)
    for stage, (first, stop) in zip(section.stages, [(0, 2), (2, 4)]):
        assert stage.layers == (first, stop) and len(stage.collectives) == 2 * (stop - first)  # o_proj, down_proj
        for tp_rank, place in enumerate(stage.ranks):
            assert (place.tp_rank, place.rank) == (tp_rank, 1 + 2 * stage.stage + tp_rank)
            assert section.place(place.rank) == (stage.stage, tp_rank)
            kv = {name: io for s in place.segments for name, io in s.inputs.items() if name.startswith("past_key_")}
            assert sorted(kv) == [f"past_key_{layer}" for layer in range(first, stop)]  # its own layers' KV only
            assert all(io["shape"][1] == 1 for io in kv.values())  # [slots, kv heads, seq, head_dim]
            assert all(s.file.startswith(f"stage{stage.stage}.rank{tp_rank}.") for s in place.segments)
    first, last = section.stages
    assert first.holds == ("embedding",) and first.sends == last.receives and first.sends
    # after the last all-reduce (final norm, lm_head) only the last stage's tp rank 0 computes
    assert "logits" in last.ranks[0].segments[-1].outputs
    assert not any("logits" in s.outputs for s in last.ranks[1].segments)
    assert len(last.ranks[1].segments) == len(last.collectives) == len(last.ranks[0].segments) - 1


@pytest.mark.e2e
def test_in_flight_identical_to_pp1_and_transformers(engines, reference):
    """Chunked prefill (8 tokens a step), requests joining a running batch, and a KV budget too small for every
    sequence at once (preemption) on each of the two virtual engines."""
    batch = prompts(reference.config.vocab_size)
    expected = parallel_helpers.hf_greedy(reference, batch, 30)
    options = dict(max_tokens_per_step=8, kv_memory_mb=0.0625, max_seq_len=48)  # KV per process: half the heads
    one, _, _ = in_flight(engines[1], batch, 30, **options)
    both, stats, overlap = in_flight(engines[(2, 2)], batch, 30, **options)
    assert one == expected
    assert both == expected
    assert stats["virtual_engines"] == 2 and overlap == 2  # a micro-batch on each stage at once
    assert stats["preemptions"] > 0


def test_logits_within_float32_tolerance(engines, reference):
    batch = prompts(reference.config.vocab_size)
    parallel_helpers.assert_every_token_logits(engines[(2, 2)], reference, batch, LOGIT_TOL)


def test_process_killed_mid_generation(engines):
    """Stage 1's tp rank 1 killed: its tp rank 0's all-reduce fails, the engine stops, the error names the one
    killed (not those that left after it), later calls raise, every process is ended."""
    llm = LLM(engines[(2, 2)])
    workers = llm.runner.workers
    try:
        handle = llm.submit([5, 6, 7], SamplingParams(max_new_tokens=80, ignore_eos=True))
        for i, _ in enumerate(handle.text_stream()):
            if i == 3:
                workers[3].send_signal(signal.SIGKILL)
        result = handle.result(timeout=60)
        assert result.finish_reason == "error"
        assert "pipeline stage 1, tp rank 1 (rank 4) exited" in result.error
        with pytest.raises(pipeline_runner.PipelineParallelError, match="stage 1, tp rank 1 .rank 4. exited"):
            llm.runner.decode(0, np.array([5]), np.array([3]))
    finally:
        llm.close()
    assert all(w.poll() is not None for w in workers)


@pytest.mark.e2e
def test_hung_process_times_out(engines, monkeypatch):
    """Stage 0's tp rank 1 stopped: its tp rank 0 waits in the all-reduce, rank 0's receive times out, and every
    process is ended."""
    monkeypatch.setattr(pipeline_runner, "TIMEOUT_S", 3.0)
    parallel_helpers.hung_worker_ends_the_engine(LLM(engines[(2, 2)]), 1)


@pytest.mark.parametrize("overrides, error, message", [
    (["parallel.pipeline_parallel=5", "parallel.tensor_parallel=2"], BuildError,
     "pipeline_parallel 5 is more than the model's 4 layers"),
    (["parallel.pipeline_parallel=2", "parallel.tensor_parallel=3"], PassError,
     "num_heads 4 is not divisible by tensor_parallel 3"),
])
def test_splits_that_do_not_fit_refused_before_any_weight_is_written(checkpoint, tmp_path, overrides, error,
                                                                     message, monkeypatch):
    import builder.build as build_module

    monkeypatch.setattr(build_module, "write_stages", lambda *a: pytest.fail("a stage was written before the refusal"))
    with pytest.raises(error, match=message):
        build(checkpoint, tmp_path / "engine", *overrides)
    assert not (tmp_path / "engine").exists()


@pytest.mark.e2e
def test_int8_pp2_tp2_gives_the_tokens_of_its_shards_without_stages(checkpoint, reference, tmp_path):
    """Each rank's shard is quantized on its own, the same with stages or without: pp2 x tp2 int8 generates what
    tp2 int8 does, and its logits are those of tp2 int8."""
    batch = prompts(reference.config.vocab_size)
    shards = build(checkpoint, tmp_path / "tp2", "quantization.mode=int8", "parallel.tensor_parallel=2")
    staged = build(checkpoint, tmp_path / "pp2tp2", "quantization.mode=int8", *PP_TP)
    assert in_flight(staged, batch)[0] == in_flight(shards, batch)[0]
    logits = []
    for engine in (shards, staged):
        llm = LLM(engine)
        try:
            logits.append(parallel_helpers.every_token_logits(llm, batch))
        finally:
            llm.close()
    for a, b in zip(*logits):
        np.testing.assert_allclose(a, b, atol=LOGIT_TOL, rtol=0)
