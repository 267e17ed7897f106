"""Tensor-parallel engines (CPU, gloo): a tiny random Llama built at tp 1, 2 and 4 generates what
transformers generates; int8 shards match int8 tp1; the rank-launch path of engine-run; a worker killed
mid-generation stops the engine with a clear error and leaves nothing running; sizes that do not divide
are refused by name."""
from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import runtime.parallel.runner as tensor_parallel
from builder.build import build_engine
from builder.pass_manager import PassError
from builder.recipe import load_recipe
from builder.shard_weights import Slice
from builder.weights import Checkpoint, CheckpointTensor, Concat
from runtime.engine import LLM
from tests.runtime import parallel_helpers
from runtime.request.params import SamplingParams
from tools.checkpoints.make_checkpoint import make_checkpoint

LOGIT_TOL = 1e-4  # float32 shards summed by all-reduce vs float32 transformers (logits ~ O(1))
NEW_TOKENS = 16


def build(checkpoint, out, tp: int, *extra: str):
    recipe = load_recipe(base={"model": str(checkpoint)},
                         overrides=["limits.max_seq_len=96", "limits.max_batch_size=4", "verify.enabled=off",
                                    f"parallel.tensor_parallel={tp}", *extra])
    return build_engine(recipe, out, log=lambda _: None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tp") / "ckpt", initializer_range=0.1, seed=3)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-engines")
    return {tp: build(checkpoint, root / f"tp{tp}", tp) for tp in (1, 2, 4)}


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(4, vocab, n).tolist() for n in (11, 3, 17, 6)]


def greedy(engine, batch) -> list[list[int]]:
    llm = LLM(engine)
    try:
        return [r.token_ids for r in llm.generate(batch, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))]
    finally:
        llm.close()


def hf_greedy(model, batch, new: int = NEW_TOKENS) -> list[list[int]]:
    return parallel_helpers.hf_greedy(model, batch, new)


def test_manifest_lists_ranks_segments_and_collectives(engines):
    import json

    manifest = json.loads((engines[2] / "manifest.json").read_text())
    section = manifest["tensor_parallel"]
    assert section["size"] == 2 and [r["rank"] for r in section["ranks"]] == [0, 1]
    assert len(section["collectives"]) == 4  # o_proj and down_proj of 2 layers
    assert len(section["ranks"][0]["segments"]) == 5 and len(section["ranks"][1]["segments"]) == 4
    assert manifest["kv_cache"]["kv_heads"] == 1  # 2 KV heads split over 2 ranks
    four = json.loads((engines[4] / "manifest.json").read_text())
    assert four["kv_cache"]["kv_heads"] == 1  # 2 KV heads replicated over 4 ranks


def test_greedy_identical_to_transformers_across_tp_sizes(engines, reference):
    batch = prompts(reference.config.vocab_size)
    expected = hf_greedy(reference, batch)
    for tp in (1, 2, 4):
        assert greedy(engines[tp], batch) == expected, f"tp={tp}"


def test_logits_within_float32_tolerance(engines, reference):
    batch = prompts(reference.config.vocab_size)
    parallel_helpers.assert_every_token_logits(engines[2], reference, batch, LOGIT_TOL)


@pytest.mark.e2e
def test_int8_shards_match_int8_tp1(tmp_path):
    """int8 quantizes each shard in blocks of 32 along K: with row-split shards of 256 columns (hidden 512,
    intermediate 1024) the blocks are tp1's, so the weights are tp1's and so are the greedy tokens. (Shards
    that cut a block quantize it in two, with scales of their own: close to tp1, not identical.)"""
    ckpt = make_checkpoint(tmp_path / "ckpt", hidden_size=512, intermediate_size=1024, num_heads=8,
                           num_kv_heads=4, num_layers=1, initializer_range=0.05, seed=5)
    batch = prompts(512)
    one = greedy(build(ckpt, tmp_path / "int8-tp1", 1, "quantization.mode=int8"), batch)
    two = greedy(build(ckpt, tmp_path / "int8-tp2", 2, "quantization.mode=int8"), batch)
    agree = np.mean([a == b for x, y in zip(one, two) for a, b in zip(x, y)])
    assert agree == 1.0, f"int8 tp2 agrees with int8 tp1 on {agree:.0%} of greedy tokens"


@pytest.mark.e2e
def test_biases_and_tied_embeddings_shard(tmp_path):
    """o_proj's bias is added once (rank 0); q/k/v biases are split with their heads; a tied lm_head works."""
    ckpt = make_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True, attention_bias=True,
                           initializer_range=0.1, seed=4)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    batch = prompts(512)[:2]
    assert greedy(build(ckpt, tmp_path / "tp2", 2), batch) == hf_greedy(model, batch)


@pytest.mark.e2e
def test_engine_run_starts_the_ranks_itself(engines):
    """engine-run on a tp2 engine (a process of its own, which must also exit: nothing left running)."""
    def run(engine):
        done = subprocess.run([sys.executable, "-m", "runtime.cli", "--engine", str(engine), "--prompt",
                               "def main():", "--max-new-tokens", "12", "--ignore-eos"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert run(engines[2]) == run(engines[1])


def test_worker_killed_mid_generation(engines):
    llm = LLM(engines[2])
    worker = llm.runner.workers[0]
    try:
        handle = llm.submit([5, 6, 7], SamplingParams(max_new_tokens=80, ignore_eos=True))
        for i, _ in enumerate(handle.text_stream()):
            if i == 3:
                worker.send_signal(signal.SIGKILL)
        result = handle.result(timeout=60)
        assert result.finish_reason == "error"
        assert "tensor-parallel worker rank 1 exited" in result.error
        with pytest.raises(tensor_parallel.TensorParallelError, match="rank 1 exited"):
            llm.runner.decode(0, np.array([5]), np.array([3]))
    finally:
        llm.close()
    assert worker.poll() is not None


@pytest.mark.e2e
def test_hung_worker_times_out(engines, monkeypatch):
    monkeypatch.setattr(tensor_parallel, "TIMEOUT_S", 3.0)
    llm = LLM(engines[2])
    worker = llm.runner.workers[0]
    try:
        worker.send_signal(signal.SIGSTOP)
        result = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))[0]
        assert result.finish_reason == "error" and "timed out after 3 s" in result.error
    finally:
        llm.close()
    assert worker.poll() is not None


@pytest.mark.parametrize("config, tp, message", [
    (dict(), 3, "num_heads 4 is not divisible by tensor_parallel 3"),
    (dict(num_heads=12, num_kv_heads=2, hidden_size=96), 3, "num_kv_heads 2 is smaller than tensor_parallel 3"),
    (dict(intermediate_size=130), 4, "intermediate_size 130 is not divisible by tensor_parallel 4"),
])
def test_sizes_that_do_not_divide_are_refused(tmp_path, config, tp, message):
    ckpt = make_checkpoint(tmp_path / "ckpt", **config)
    with pytest.raises(PassError, match=message):
        build(ckpt, tmp_path / "engine", tp)
    assert not (tmp_path / "engine").exists()


def test_slices_read_only_their_rows(checkpoint):
    ckpt = Checkpoint(checkpoint)
    q = CheckpointTensor(ckpt, "model.layers.0.self_attn.q_proj.weight")
    k = CheckpointTensor(ckpt, "model.layers.0.self_attn.k_proj.weight")
    packed = Concat([q, k])
    rows = Slice(packed, 0, [(16, 32), (64, 80)])
    whole = packed.materialize()
    np.testing.assert_array_equal(rows.materialize(), np.concatenate([whole[16:32], whole[64:80]]))
    cols = Slice(q, 1, [(8, 40)])
    np.testing.assert_array_equal(cols.materialize(), q.materialize()[:, 8:40])
    with pytest.raises(ValueError, match="outside axis 0"):
        Slice(q, 0, [(0, 999)])


def test_prefix_copied_between_slots_on_every_rank(engines):
    """A prompt sharing a long prefix with a busy sequence copies that KV into its own slot: rank 0 in
    KVCache.claim, the workers from the queued copy; the tokens match the tp1 engine's."""
    shared = prompts(512)[2]
    batch = [shared + [9], shared + [40, 41], shared]
    results = {}
    for tp in (1, 2):
        llm = LLM(engines[tp])
        try:
            first = llm.submit(batch[0], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
            next(first.text_stream())  # the first sequence is busy in its slot
            rest = [llm.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)) for p in batch[1:]]
            results[tp] = [h.result().token_ids for h in [first] + rest]
            assert llm.executor.totals["prompt_tokens_reused"] >= 2 * ((len(shared) - 1) // 16 * 16)  # whole blocks
            if tp == 2:
                assert llm.runner.copies_sent >= 1
        finally:
            llm.close()
    assert results[2] == results[1]


def test_ngram_speculation_on_a_tp_engine(engines):
    """Speculative verify calls (several tokens on top of a past) run on every rank: the tokens are the
    plain greedy ones (fallback off, so drafts are verified whatever they cost)."""
    from runtime.speculation.speculator import Speculation

    repetitive = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]
    llm = LLM(engines[2])
    try:
        plain = llm.generate([repetitive], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
        spec = llm.generate([repetitive], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                            speculation=Speculation("ngram", num_draft=3, fallback=False))[0]
    finally:
        llm.close()
    assert spec.token_ids == plain.token_ids
    assert spec.metrics["speculation"]["drafted"] > 0


def test_steps_run_ahead_on_a_tp_engine(engines):
    """Overlap and steps run ahead (the CUDA default) on rank 0: greedy rows take the ArgMax of the all-reduced
    logits on rank 0, so their decode steps chain, each a decode the ranks run in turn; rows finish at different
    lengths inside chains, and the tokens are tp1's one step at a time."""
    batch = prompts(512)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, NEW_TOKENS, 9, 3)]
    expected = greedy(engines[1], batch)
    llm = LLM(engines[2], overlap=True, lookahead=4)
    try:
        got = [r.token_ids for r in llm.generate(batch, params)]
        assert llm.executor.totals["steps_run_ahead"] > 0
    finally:
        llm.close()
    assert got == [tokens[:p.max_new_tokens] for tokens, p in zip(expected, params)]
