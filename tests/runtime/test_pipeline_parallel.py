"""Pipeline-parallel engines (CPU, gloo): a tiny random 4-layer Llama split into 2 and 4 stages generates what
pp1 and transformers generate, in flight (requests joining a running batch), with chunked prefill, prefix
reuse, preemption, n-gram speculation and int8 KV; micro-batches of both virtual engines are in flight at once; logits match transformers;
a stage killed or hung mid-generation stops the engine with an error naming it and leaves nothing running."""
from __future__ import annotations

import signal

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import runtime.parallel.pipeline_runner as pipeline_runner
from builder.build import build_engine
from builder.recipe import load_recipe
from runtime.engine import LLM
from tests.runtime import parallel_helpers
from runtime.manifest.load import read_manifest
from runtime.request.params import SamplingParams
from runtime.speculation.speculator import Speculation
from tools.checkpoints.make_checkpoint import make_checkpoint

LOGIT_TOL = 1e-4  # float32 stages vs float32 transformers (logits ~ O(1))
NEW_TOKENS = 12


def build(checkpoint, out, *extra: str):
    recipe = load_recipe(base={"model": str(checkpoint)},
                         overrides=["limits.max_seq_len=96", "limits.max_batch_size=6", "verify.enabled=off", *extra])
    return build_engine(recipe, out, log=lambda _: None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("pp") / "ckpt", num_layers=4, initializer_range=0.1, seed=3)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-engines")
    return {1: build(checkpoint, root / "pp1"), 2: build(checkpoint, root / "pp2", "parallel.pipeline_parallel=2")}


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(4, vocab, n).tolist() for n in (11, 3, 17, 6, 9, 2)]


def hf_greedy(model, batch, new: int = NEW_TOKENS) -> list[list[int]]:
    return parallel_helpers.hf_greedy(model, batch, new)


def in_flight(engine, batch, new: int = NEW_TOKENS, **options) -> tuple[list[list[int]], dict, int]:
    """Half the prompts, then the rest while those run (each as it comes, joining a running batch); the tokens,
    the executor's stats and the most calls the runner had in flight at once."""
    llm = LLM(engine, **options)
    try:
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        first = llm.executor.submit_sequences([llm.make_sequence(p, params) for p in batch[:3]])
        next(first[0].text_stream())  # the first tokens are out: the batch runs
        later = [llm.submit(p, params) for p in batch[3:]]
        tokens = [h.result(timeout=120).token_ids for h in first + later]
        return tokens, llm.executor.stats(), getattr(llm.runner, "calls_in_flight_max", 1)
    finally:
        llm.close()


def test_manifest_says_which_stage_holds_what(engines):
    section = read_manifest(engines[2]).pipeline_parallel
    assert section.size == 2
    first, last = section.stages
    assert (first.layers, last.layers) == ((0, 2), (2, 4))  # equal layers, lm_head on the last: balanced 2 + 2
    assert first.holds == ("embedding",) and last.holds == ("final_norm", "lm_head", "sampling_head")
    assert section.tensor_parallel == 1 and [s.ranks[0].rank for s in section.stages] == [1, 2]
    (head,), (tail,) = first.ranks[0].segments, last.ranks[0].segments  # one segment a stage, no all-reduces
    assert head.layers == (0, 1) and tail.layers == (2, 3)  # each stage's KV: its own layers
    assert not any(name.endswith(("_2", "_3")) for name in head.inputs if name.startswith("past_"))
    assert first.sends == last.receives and first.sends and not last.sends
    assert "input_ids" in head.inputs and "input_ids" not in tail.inputs
    assert "logits" in tail.outputs and "logits" not in head.outputs


def test_engine_built_before_pipeline_x_tensor_parallelism_keeps_loading(engines, reference, tmp_path):
    """Such an engine's stages have one `segment` each in place of `ranks`: it loads and gives the same tokens."""
    import json
    import shutil

    old = tmp_path / "pp2-old"
    shutil.copytree(engines[2], old)
    data = json.loads((old / "manifest.json").read_text())
    for stage in data["pipeline_parallel"]["stages"]:
        (rank,) = stage.pop("ranks")
        (stage["segment"],) = rank["segments"]
    (old / "manifest.json").write_text(json.dumps(data))
    section = read_manifest(old).pipeline_parallel
    assert [(s.ranks[0].rank, s.ranks[0].segments) for s in section.stages] == \
        [(s.ranks[0].rank, s.ranks[0].segments) for s in read_manifest(engines[2]).pipeline_parallel.stages]
    batch = prompts(reference.config.vocab_size)[:2]
    assert in_flight(old, batch, 6)[0] == hf_greedy(reference, batch, 6)


def test_pp2_identical_to_pp1_and_transformers_in_flight(engines, reference):
    """Chunked prefill (8 tokens a step), requests joining a running batch, and a KV budget too small for every
    sequence at once (preemption) on each virtual engine (4 blocks of 16 tokens each, 1 KB a token; a sequence
    grows to 3)."""
    batch = prompts(reference.config.vocab_size)
    expected = hf_greedy(reference, batch, 30)
    options = dict(max_tokens_per_step=8, kv_memory_mb=0.125, max_seq_len=48)
    one, _, _ = in_flight(engines[1], batch, 30, **options)
    two, stats, overlap = in_flight(engines[2], batch, 30, **options)
    assert one == expected
    assert two == expected
    assert stats["virtual_engines"] == 2 and overlap == 2  # a micro-batch on each stage at once
    assert stats["preemptions"] > 0


def test_prefix_reuse_and_ngram_speculation(engines, reference):
    """A prompt that starts with another's 16 tokens (a whole block) reuses its KV: the copy is replayed on
    each stage's layers. n-gram speculation's verify calls run through the stages. Tokens are transformers'."""
    first = prompts(reference.config.vocab_size)[2]
    second, repeating = first[:16] + [9, 10], [7, 8, 9, 10] * 5
    llm = LLM(engines[2])
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        tokens = [llm.generate([p], params)[0].token_ids for p in (first, second)]
        assert llm.executor.stats()["prefix_cache_hit_tokens"] == 16
        speculating = llm.make_sequence(repeating, params, Speculation("ngram"))
        tokens.append(llm.executor.submit_sequence(speculating).result(timeout=120).token_ids)
        assert speculating.speculation.calls > 0  # verify calls ran
    finally:
        llm.close()
    assert tokens == hf_greedy(reference, [first, second, repeating])


def test_logits_within_float32_tolerance(engines, reference):
    batch = prompts(reference.config.vocab_size)
    parallel_helpers.assert_every_token_logits(engines[2], reference, batch, LOGIT_TOL)


@pytest.mark.e2e
def test_pp4_and_given_layers_identical_to_pp1(engines, checkpoint, reference, tmp_path):
    batch = prompts(reference.config.vocab_size)
    expected = hf_greedy(reference, batch)
    for extra in (["parallel.pipeline_parallel=4"],
                  ["parallel.pipeline_parallel=2", "parallel.pipeline_layers=[1, 3]"]):
        engine = build(checkpoint, tmp_path / "engine", *extra)
        tokens, _, _ = in_flight(engine, batch)
        assert tokens == expected, extra


@pytest.mark.e2e
def test_int8_kv_pp2_identical_to_pp1(checkpoint, tmp_path):
    batch = prompts(512)
    one = in_flight(build(checkpoint, tmp_path / "int8-pp1", "kv_cache.dtype=int8"), batch)[0]
    two = in_flight(build(checkpoint, tmp_path / "int8-pp2", "kv_cache.dtype=int8",
                          "parallel.pipeline_parallel=2"), batch)[0]
    assert one == two


def test_stage_killed_mid_generation(engines):
    llm = LLM(engines[2])
    stage = llm.runner.workers[1]
    try:
        handle = llm.submit([5, 6, 7], SamplingParams(max_new_tokens=80, ignore_eos=True))
        for i, _ in enumerate(handle.text_stream()):
            if i == 3:
                stage.send_signal(signal.SIGKILL)
        result = handle.result(timeout=60)
        assert result.finish_reason == "error"
        assert "pipeline stage 1 (rank 2) exited" in result.error
        with pytest.raises(pipeline_runner.PipelineParallelError, match="stage 1 .rank 2. exited"):
            llm.runner.decode(0, np.array([5]), np.array([3]))
    finally:
        llm.close()
    assert all(w.poll() is not None for w in llm.runner.workers)


@pytest.mark.e2e
def test_hung_stage_times_out(engines, monkeypatch):
    monkeypatch.setattr(pipeline_runner, "TIMEOUT_S", 3.0)
    parallel_helpers.hung_worker_ends_the_engine(LLM(engines[2]), 0)


@pytest.mark.parametrize("wanted, slots, blocks, expected", [
    (2, 16, 48, 2), (2, 1, 48, 1),  # one KV slot: one micro-batch (engine-run's batch 1)
    (3, 16, 10, 1), (4, 16, 13, 2),  # blocks for one 96-token sequence (6 of 16 tokens) per micro-batch
])
def test_fewer_micro_batches_where_slots_or_blocks_do_not_go_round(wanted, slots, blocks, expected):
    from runtime.batching.block_table import BlockConfig
    from runtime.parallel.virtual_engines import micro_batches

    assert micro_batches(wanted, slots, BlockConfig(blocks, 16), 96) == expected
