"""A paged engine driven by LLM, the executor and the scheduler (issue 29): the scheduler's blocks are the
device pool's, prefix-cache hits are shared by reference (no copy), a cached token computed again is not
written (slot_mapping -1), and preemption, speculation and sharing leave every request with the tokens it
gets alone. PagedAttention has no CPU kernel, so the session is tests/runtime/paged_fake.py: it checks each
call's layout against the token histories and plays a deterministic model (the GPU run is test_paged_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.batching.block_pool import BlockPool
from runtime.batching.block_table import BlockConfig
from runtime.batching.paged_table import PagedTable
from runtime.engine import LLM
from runtime.manifest.load import EngineError
from runtime.model import paged_runner
from runtime.request.params import SamplingParams
from runtime.speculation.speculator import Speculation
from tests.runtime.paged_fake import VOCAB, FakeSession, reference_run

BLOCK = 16


@pytest.fixture(scope="module")
def paged_engine(tmp_path_factory):
    from tools.gpu.steps import TINY, build
    from tools.checkpoints.make_checkpoint import make_checkpoint

    checkpoint = make_checkpoint(tmp_path_factory.mktemp("paged") / "ckpt", **TINY, seed=0)
    engine, _ = build(checkpoint, tmp_path_factory.mktemp("paged") / "engine", "cuda", "float16", "none", 4, 96,
                      "target.attention=paged")
    return engine


@pytest.fixture
def fake(monkeypatch, paged_engine):
    """LLM's paged runner opens this session instead of a CUDA one."""
    session = FakeSession(paged_engine / "model.onnx", BLOCK)
    monkeypatch.setattr(paged_runner, "open_paged_session", lambda *args: session)
    return session


def test_a_schedule_with_shared_prefixes_preemption_and_speculation(paged_engine, fake):
    """Wave 1 leaves a 32-token system prompt cached; wave 2 (8 requests on 4 rows, a budget of 12 blocks where
    four need 18) shares it by reference, one prompt is exactly that prefix, half speculate with n-grams."""
    system = [4 + (5 * i) % 300 for i in range(2 * BLOCK)]
    rng = np.random.default_rng(3)
    wave2 = [system] + [system + rng.integers(4, VOCAB, int(rng.integers(3, 20))).tolist() for _ in range(7)]
    llm = LLM(paged_engine, device="cpu", max_batch_size=4, kv_memory_mb=12 * BLOCK * 256 / 2**20,
              max_tokens_per_step=32)
    try:
        assert llm.spec.bytes_per_token == 256 and llm.blocks.num_blocks == 12
        assert isinstance(llm.executor.kv, PagedTable) and isinstance(llm.runner, paged_runner.PagedModelRunner)
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        first = llm.generate([system + [7, 8, 9]], params)[0].token_ids
        handles = [llm.submit(p, params, Speculation("ngram", fallback=False) if i % 2 else None) for i, p in enumerate(wave2)]
        results = [h.result(timeout=120).token_ids for h in handles]
        stats, pool = llm.executor.stats(), llm.executor.scheduler.blocks
    finally:
        llm.close()
    assert first == reference_run(system + [7, 8, 9], 40)
    assert results == [reference_run(p, 40) for p in wave2]  # every read went to the request's own history
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
    assert stats["prefix_cache_hit_tokens"] >= 8 * 2 * BLOCK - 1  # every wave-2 prompt shared the system blocks
    spec = [h.seq.speculation for h in handles[1::2]]
    assert sum(s.drafted for s in spec) > sum(s.accepted for s in spec) > 0  # drafts accepted and rejected
    steps = fake.calls
    assert any(len(c.feeds["past_seqlens"]) > 1 and _shared(c.feeds["block_table"]) for c in steps)
    assert any((c.feeds["slot_mapping"] == -1).any() for c in steps)  # the whole-prefix prompt's last token
    assert any(len(c.feeds["past_seqlens"]) >= 3 for c in steps)  # decode rows packed in one call
    assert any(1 in np.diff(c.feeds["cumulative_sequence_length"]) and np.diff(c.feeds["cumulative_sequence_length"]).max() > 1
               for c in steps)  # decode rows and a prompt chunk in one call
    for call in steps:
        check_layout(call.feeds)
    assert sum(pool.refs) == 0 and pool.used == len(pool.lru) > 0  # nothing referenced; cached blocks stay


def _shared(table: np.ndarray) -> bool:
    ids = table[table >= 0]
    return len(set(ids.tolist())) < len(ids)


def check_layout(feeds: dict) -> None:
    """Each call's layout against a reference from the packed rows alone: offsets are the running sum of the
    rows' new tokens, token j of row i sits at position past_i + j in block table[i, pos // 16], written to
    that block's slot unless skipped, and the metadata bounds the longest run and the longest total."""
    cum, past, table = feeds["cumulative_sequence_length"], feeds["past_seqlens"], feeds["block_table"]
    new = np.diff(cum)
    assert cum[0] == 0 and (new > 0).all() and cum[-1] == feeds["input_ids"].shape[1]
    positions = np.concatenate([p + np.arange(n) for p, n in zip(past, new)])
    rows = np.repeat(np.arange(len(past)), new)
    slots = table[rows, positions // BLOCK] * BLOCK + positions % BLOCK
    written = feeds["slot_mapping"] != -1
    np.testing.assert_array_equal(feeds["slot_mapping"][written], slots[written])
    assert feeds["attention_metadata"].tolist() == [new.max(), (past + new).max()]
    assert table.shape[1] == 96 // BLOCK and all(a.dtype == np.int32 for k, a in feeds.items() if k != "input_ids"
                                                  and k not in ("logits_index", "top_k"))


def test_block_pool_shares_by_reference_and_evicts_unreferenced_blocks_lru():
    pool = BlockPool(BlockConfig(6, 2), rows=3)
    assert pool.reserve(0, 5)  # 3 blocks
    pool.register(0, [1, 2, 3, 4, 5])  # two full blocks indexed, the third is partial
    prefix = pool.match([1, 2, 3, 4, 9])
    blocks = prefix.blocks
    assert blocks == pool.rows[0][:2] and prefix.tokens == 4 and prefix.row == -1  # any row may share them
    pool.share(1, prefix)
    assert pool.reserve(1, 6) and pool.refs[blocks[0]] == 2 and pool.present[1] == 4
    pool.release(0)  # the shared blocks keep a reference; row 0's partial block is free again
    assert pool.refs[blocks[0]] == 1 and not pool.lru and pool.used == 3
    pool.register(1, [1, 2, 3, 4, 7, 8])
    held = list(pool.rows[1])
    pool.release(1)  # all three full blocks cached, unreferenced, the tail first in line
    assert list(pool.lru) == held[::-1] and pool.match([1, 2, 3, 4, 7, 8]).blocks == held
    tail = held[-1]
    assert pool.reserve(2, 8)  # 3 free + one evicted: the tail, so the prefix stays findable
    assert tail not in pool.lru and pool.match([1, 2, 3, 4, 7, 8]).blocks == blocks
    assert not pool.reserve(2, 13) and len(pool.rows[2]) == 4  # past the budget: nothing taken


def test_block_pool_keeps_the_first_copy_of_a_block_indexed():
    pool = BlockPool(BlockConfig(4, 2), rows=2)
    for row in (0, 1):  # both computed the same block (admitted together): one is the cached copy
        pool.reserve(row, 2)
        pool.register(row, [5, 6])
    assert pool.match([5, 6]).blocks == [pool.rows[0][0]]
    pool.release(1)
    assert pool.rows[1] == [] and len(pool.free_ids) == 3  # its private copy is free, not cached


def test_paged_engine_on_cpu_is_refused_with_the_way_out(paged_engine):
    with pytest.raises(EngineError, match="only on CUDA.*device 'cuda'.*target.attention=gqa"):
        LLM(paged_engine, device="cpu")


def test_block_size_other_than_the_paged_engines_is_refused(paged_engine, fake):
    with pytest.raises(EngineError, match="block_size 8: this paged engine's blocks are 16 tokens"):
        LLM(paged_engine, device="cpu", block_size=8)


def test_seeded_sampling_on_a_paged_engine_matches_running_alone(paged_engine, fake):
    """The sampling head's candidates (top_k within the engine's) and full logits (top_k 0) through packed
    calls: each seeded request draws what it draws alone, beside others, preempted and sharing blocks."""
    system = [4 + (3 * i) % 200 for i in range(BLOCK)]
    prompts = [system + [5 + i] * (i + 1) for i in range(6)]
    params = [SamplingParams(max_new_tokens=30, temperature=0.8, top_k=20 if i % 2 else 0, seed=i, ignore_eos=True)
              for i in range(6)]

    def run(batch: int, budget_blocks: int, together: bool) -> tuple[list[list[int]], dict]:
        llm = LLM(paged_engine, device="cpu", max_batch_size=batch, kv_memory_mb=budget_blocks * BLOCK * 256 / 2**20)
        try:
            if together:  # all queued before the first step (else the first may cache the prefix alone first)
                with llm.executor._lock:
                    handles = [llm.submit(p, sp) for p, sp in zip(prompts, params)]
                tokens = [h.result(timeout=120).token_ids for h in handles]
            else:
                tokens = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
            return tokens, llm.executor.stats()
        finally:
            llm.close()

    (together, stats), (alone, _) = run(4, 9, together=True), run(1, 6, together=False)
    assert together == alone
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    heads = {tuple(c.outputs) for c in fake.calls}
    assert ("topk_values", "topk_indices") in heads and ("logits",) in heads


def test_steps_run_ahead_on_a_paged_engine(paged_engine, fake):
    """Overlap and steps run ahead (the CUDA default) on a paged engine: a chain copies its rows' block ids when it
    starts and every chained call reads only its own history through them (the fake refuses any other read),
    though rows finish inside chains and their blocks go back to the pool meanwhile; greedy and top-k rows, a
    shared prefix, requests arriving mid-chain. The tokens are the reference model's."""
    system = [4 + (5 * i) % 300 for i in range(BLOCK)]
    prompts = [system + [9 + i] * (i + 2) for i in range(6)]
    lengths = (7, 30, 13, 22, 5, 18)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    llm = LLM(paged_engine, device="cpu", max_batch_size=4, overlap=True, lookahead=6)
    try:
        handles = [llm.submit(p, sp) for p, sp in zip(prompts[:4], params[:4])]
        next(iter(handles[1]))
        handles += [llm.submit(p, sp) for p, sp in zip(prompts[4:], params[4:])]  # while chains run
        results = [h.result(timeout=120).token_ids for h in handles]
        ran, pool = llm.executor.totals["steps_run_ahead"], llm.executor.scheduler.blocks
        seeded = SamplingParams(max_new_tokens=20, temperature=0.8, top_k=20, seed=4, ignore_eos=True)
        drawn = llm.generate([prompts[0]], seeded)[0].token_ids
    finally:
        llm.close()
    assert results == [reference_run(p, n) for p, n in zip(prompts, lengths)]
    assert ran > 0 and sum(pool.refs) == 0
    for call in fake.calls:
        check_layout(call.feeds)
    alone = LLM(paged_engine, device="cpu", max_batch_size=1)
    try:
        assert drawn == alone.generate([prompts[0]], seeded)[0].token_ids
    finally:
        alone.close()


def test_prompt_logprobs_on_a_paged_engine_are_refused_before_any_model_call(paged_engine, fake):
    """A paged engine's packed calls return each row's last logits only: prompt_logprobs (lm-eval's echo + logprobs
    scoring) is refused when the request is validated, through the Python API and engine-serve, with no call made."""
    import httpx

    from runtime.engine import RequestError
    from runtime.serve.app import RunningServer, create_app

    llm = LLM(paged_engine, device="cpu")
    running = RunningServer(create_app({"paged": llm}))
    try:
        calls = len(fake.calls)
        with pytest.raises(RequestError, match="prompt_logprobs are not available on a paged engine") as info:
            llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, prompt_logprobs=1))
        assert info.value.field == "prompt_logprobs"
        r = httpx.post(f"{running.url}/v1/completions", timeout=60, json={
            "model": "paged", "prompt": [5, 6, 7], "echo": True, "logprobs": 1, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        assert "paged engine" in r.json()["error"]["message"]
        assert len(fake.calls) == calls and llm.executor.totals["steps"] == 0
    finally:
        running.stop()
        llm.close()
