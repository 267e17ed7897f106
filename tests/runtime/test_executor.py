"""The in-flight batching executor: concurrent requests produce exactly what they produce alone,
cancellation frees slots, bad requests are rejected at submit, prefix reuse is exact."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from runtime.engine import LLM, RequestError
from runtime.request.params import SamplingParams
from runtime.request.sequence import Status


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


def alone(engine, prompt, params):
    llm = LLM(engine, max_batch_size=1)
    try:
        return llm.generate([prompt], params)[0].token_ids
    finally:
        llm.close()


def prompts_and_params(n: int):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(4, 512, int(rng.integers(2, 40))).tolist() for _ in range(n)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(4, 20)), ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_new_tokens=int(rng.integers(4, 20)), ignore_eos=True, temperature=0.9,
                             top_p=0.9, top_k=40, seed=i) for i in range(n)]
    return prompts, params


def test_concurrent_requests_match_running_alone(engine):
    prompts, params = prompts_and_params(6)
    llm = LLM(engine, max_tokens_per_step=16)  # small budget: prompts are chunked while others decode
    handles = [llm.submit(p, sp) for p, sp in zip(prompts, params)]
    results = [h.result(timeout=60) for h in handles]
    for p, sp, r in zip(prompts, params, results):
        assert r.token_ids == alone(engine, p, sp)
        assert r.finish_reason == "length" and len(r.token_ids) == sp.max_new_tokens
    llm.close()


def test_staggered_arrivals_join_running_batch(engine):
    prompts, params = prompts_and_params(5)
    llm = LLM(engine, max_batch_size=3)
    handles = []
    for p, sp in zip(prompts, params):
        handles.append(llm.submit(p, sp))
        time.sleep(0.01)
    for p, sp, h in zip(prompts, params, handles):
        assert h.result(timeout=60).token_ids == alone(engine, p, sp)
    assert sorted(llm.executor.scheduler.slots.free) == [0, 1, 2]
    llm.close()


def test_cancel_mid_stream_frees_slot(engine, monkeypatch):
    llm = LLM(engine, max_batch_size=2)
    decode = llm.runner.decode  # a step of >= 1 ms: the 80 tokens cannot all be out before the cancel is seen
    monkeypatch.setattr(llm.runner, "decode", lambda *a, **k: (time.sleep(0.001), decode(*a, **k))[1])
    long = llm.submit("def f(x):", SamplingParams(max_new_tokens=80, ignore_eos=True))
    other = llm.submit("import os", SamplingParams(max_new_tokens=30, ignore_eos=True))
    received = []
    for out in long:
        received.append(out.token_id)
        if len(received) == 3:
            long.cancel()
    result = long.result(timeout=30)
    assert result.finish_reason == "cancelled" and 3 <= len(result.token_ids) < 80
    assert other.result(timeout=30).finish_reason == "length"
    deadline = time.time() + 5
    while len(llm.executor.scheduler.slots.free) != 2 and time.time() < deadline:
        time.sleep(0.01)
    assert sorted(llm.executor.scheduler.slots.free) == [0, 1]
    llm.close()


def test_too_long_request_rejected_at_submit_others_continue(engine):
    llm = LLM(engine)
    ok = llm.submit("class A:", SamplingParams(max_new_tokens=10, ignore_eos=True))
    with pytest.raises(RequestError, match="exceeds max_seq_len"):
        llm.submit([5] * 90, SamplingParams(max_new_tokens=20))
    assert ok.result(timeout=30).finish_reason == "length"
    llm.close()


def test_failing_request_does_not_affect_others(engine, monkeypatch):
    llm = LLM(engine)
    good = llm.submit("x = 1", SamplingParams(max_new_tokens=12, ignore_eos=True))
    # a repetition penalty samples on the host from the logits and the history (a greedy row reads the graph's ArgMax)
    bad_seq = llm.make_sequence("y = 2", SamplingParams(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.1))
    monkeypatch.setattr(bad_seq, "history", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    bad = llm.executor.submit_sequence(bad_seq)
    assert bad.result(timeout=30).finish_reason == "error" and "boom" in bad.result().error
    assert good.result(timeout=30).token_ids == alone(engine, "x = 1", SamplingParams(max_new_tokens=12,
                                                                                      ignore_eos=True))
    llm.close()


def test_a_bug_in_the_step_loop_ends_every_request_instead_of_hanging(engine, monkeypatch, capfd):
    """An exception that escapes a step (a bug, not a failed engine call) ends every running and waiting request
    with its error, prints its traceback, and later submissions are refused naming it."""
    llm = LLM(engine, max_batch_size=2)
    calls, submitted = {"n": 0}, threading.Event()
    schedule = llm.executor.scheduler.schedule

    def failing():  # the third step after all three are submitted (a fast box could fail before the last submit)
        if submitted.is_set():
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyError("slot 7")
        return schedule()

    monkeypatch.setattr(llm.executor.scheduler, "schedule", failing)
    handles = [llm.submit(f"x = {i}", SamplingParams(max_new_tokens=40, ignore_eos=True)) for i in range(3)]
    submitted.set()
    results = [h.result(timeout=30) for h in handles]
    assert all(r.finish_reason == "error" and "the executor stopped: KeyError: 'slot 7'" in r.error for r in results)
    assert "KeyError" in capfd.readouterr().err
    with pytest.raises(RuntimeError, match="shut down .KeyError"):
        llm.submit("z", SamplingParams(max_new_tokens=2))
    llm.close()


def test_stress_many_short_requests_all_finish_and_free(engine):
    llm = LLM(engine, max_batch_size=4, max_tokens_per_step=24)
    rng = np.random.default_rng(5)
    handles = [llm.submit(rng.integers(4, 512, int(rng.integers(1, 12))).tolist(),
                          SamplingParams(max_new_tokens=int(rng.integers(1, 6)), ignore_eos=True))
               for _ in range(60)]
    results = [h.result(timeout=120) for h in handles]
    assert all(r.finish_reason == "length" for r in results)
    stats = llm.executor.stats()
    assert stats["queue_depth"] == 0 and stats["running"] == 0 and stats["free_slots"] == 4
    assert stats["finished"] == 60 and stats["generated_tokens"] == sum(len(r.token_ids) for r in results)
    llm.close()


def test_prefix_reuse_gives_same_tokens(engine):
    system = list(range(10, 60))  # a 50-token shared "system prompt"
    questions = [[70, 71, 72], [80, 81, 82, 83, 84], [90]]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    llm = LLM(engine, max_batch_size=2, min_prefix_reuse=8)
    first = llm.generate([system + questions[0]], params)[0]
    rest = llm.generate([system + q for q in questions[1:]], params)
    assert [r.metrics["reused_prompt_tokens"] for r in rest] == [48, 48]  # whole 16-token blocks of the 50
    no_reuse = LLM(engine, max_batch_size=2, min_prefix_reuse=10_000)
    expected = no_reuse.generate([system + q for q in questions], params)
    assert [first.token_ids] + [r.token_ids for r in rest] == [e.token_ids for e in expected]
    assert all(e.metrics["reused_prompt_tokens"] == 0 for e in expected)
    llm.close(), no_reuse.close()


def test_prefix_reuse_from_running_request_copies_kv(engine):
    system = list(range(100, 140))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    llm = LLM(engine, max_batch_size=2, min_prefix_reuse=8)
    running = llm.submit(system + [5], params)
    next(iter(running))  # its prompt is cached and it is decoding
    second = llm.submit(system + [6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True)).result(timeout=30)
    assert second.metrics["reused_prompt_tokens"] == 32  # the 40-token prefix's two whole 16-token blocks
    assert second.token_ids == alone(engine, system + [6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True))
    running.result(timeout=30)
    llm.close()


def test_async_iteration_and_metrics(engine):
    llm = LLM(engine)

    async def collect():
        handle = llm.submit("def main():", SamplingParams(max_new_tokens=6, ignore_eos=True))
        return handle, [o.token_id async for o in handle]

    handle, tokens = asyncio.run(collect())
    result = handle.result()
    assert tokens == result.token_ids and len(tokens) == 6
    m = result.metrics
    assert m["ttft_s"] > 0 and m["tpot_s"] > 0 and m["output_tokens"] == 6 and m["prompt_tokens"] > 0
    assert llm.executor.stats()["tokens_per_s"] >= 0
    llm.close()


def test_status_lifecycle(engine):
    llm = LLM(engine)
    seq = llm.make_sequence("a", SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert seq.status is Status.WAITING
    llm.executor.submit_sequence(seq).result(timeout=30)
    assert seq.status is Status.FINISHED and seq.finish_reason == "length"
    llm.close()


def test_fresh_slots_keep_the_decode_range_compact(engine):
    """A decode call covers the range of busy rows: a new request fills a hole in that range (an
    empty row before one whose released blocks may be reused) before widening it."""
    from runtime.batching.block_table import BlockConfig
    from runtime.batching.scheduler import Scheduler
    from runtime.model.kv_cache import KVCache
    from runtime.manifest.kv_spec import KVCacheSpec
    from runtime.request.sequence import Sequence

    spec = KVCacheSpec(num_layers=1, kv_heads=1, head_dim=2, dtype="float32", slots=6, max_seq_len=8)
    scheduler = Scheduler(KVCache(spec), 6, 64, 2, BlockConfig(24, 2))
    tokenizer = LLM(engine).tokenizer

    def admit(prompt):
        seq = Sequence(prompt, SamplingParams(max_new_tokens=1), tokenizer, frozenset())
        scheduler.add(seq)
        scheduler.schedule()
        return seq

    a0, a1, a2, a3 = admit([5, 6, 7, 8, 9]), admit([3, 4, 5]), admit([11, 12, 13]), admit([14, 15, 16])
    assert [a.slot for a in (a0, a1, a2, a3)] == [0, 1, 2, 3]
    scheduler.advance([a1], 3)
    scheduler.retire(a1)  # a finished request: its full block [3, 4] stays findable in row 1
    scheduler.retire(a2)
    assert [(s.slot, s.reused) for s in (admit([1, 2, 3]), admit([1, 2, 3]))] == [(2, 0), (1, 0)]  # holes first
    d = admit([1, 2, 3])
    assert d.slot == 4  # no hole left: the lowest row above
    scheduler.retire(d)
    scheduler.advance([a0], 5)
    scheduler.retire(a0)
    again = admit([5, 6, 7, 8, 1])
    assert (again.slot, again.reused) == (0, 4)  # prefix reuse still wins, in place


@pytest.mark.parametrize("options", [{"max_running": 0}, {"max_running": -2}, {"max_tokens_per_step": 0},
                                     {"min_prefix_reuse": 1.5}])
def test_bad_executor_options_are_rejected_at_once(engine, options):
    from runtime.batching.executor import Executor
    from runtime.config import ExecutorConfig

    llm = LLM(engine)
    try:
        with pytest.raises(ValueError, match=next(iter(options)) + " must be an integer >= 1"):
            Executor(llm.runner, config=ExecutorConfig(**options))
    finally:
        llm.close()


def test_step_history_stays_bounded_without_stats(engine, monkeypatch):
    """The per-step record behind stats()["tokens_per_s"] keeps only its window even when stats() is never
    called (a server nobody scrapes): it grew by one entry per step, ~3 MB a minute under the soak."""
    import runtime.batching.executor as executor_module

    monkeypatch.setattr(executor_module, "RATE_WINDOW_S", 0.0)  # keep no step older than now
    llm = LLM(engine)
    try:
        llm.generate([[5, 6, 7]] * 2, SamplingParams(max_new_tokens=60, ignore_eos=True))
        steps = llm.executor.totals["steps"]
        assert steps >= 60 and len(llm.executor._recent) <= 1
        assert llm.executor.stats()["tokens_per_s"] >= 0
    finally:
        llm.close()


def test_a_closed_llm_refuses_work_instead_of_starting_again(engine):
    """close() is final and idempotent: a later generate names the closed engine (it started a fresh executor that
    nothing would shut down)."""
    llm = LLM(engine)
    llm.generate(["x"], SamplingParams(max_new_tokens=2))
    llm.close()
    llm.close()
    assert llm.closed
    with pytest.raises(RuntimeError, match="is closed: load the engine again"):
        llm.generate(["x"], SamplingParams(max_new_tokens=2))
