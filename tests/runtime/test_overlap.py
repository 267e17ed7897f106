"""Overlap (ExecutorConfig.overlap): the engine call runs on its own thread while the executor's thread renders the
last step's tokens. Off by default on CPU (the engine's threads use every core), on for CUDA; forced on here
on CPU it must give the same tokens, text, finish reasons and stream events as off, stop strings found one
step late included (their extra tokens dropped)."""
from __future__ import annotations

import pytest

from runtime.batching.executor import Executor
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.speculation.speculator import Speculation

PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "x = [1, 2, 3]\nfor"]


@pytest.fixture(scope="module")
def engines(trained_engine):
    off, on = LLM(trained_engine, threads=1), LLM(trained_engine, threads=1, overlap=True)
    yield off, on
    off.close(), on.close()


def _outcome(llm, params, speculation=None):
    return [(c.token_ids, c.text, c.finish_reason) for c in llm.generate(PROMPTS, params, speculation)]


def test_off_on_cpu_and_on_for_cuda(engines):
    off, on = engines
    assert off.executor._engine is None and on.executor._engine is not None
    runner = off.runner
    device = runner.cache.device
    try:
        runner.cache.device = "cuda"  # the default follows the device the KV lives on
        executor = Executor(runner)
        assert executor._engine is not None
        executor.shutdown()
    finally:
        runner.cache.device = device


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=24, ignore_eos=True),
                                    SamplingParams(max_new_tokens=40),  # EOS may end a row
                                    SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7),
                                    SamplingParams(max_new_tokens=24, temperature=0.7, top_k=5, seed=3)])
def test_same_tokens_and_text(engines, params):
    off, on = engines
    assert _outcome(on, params) == _outcome(off, params)


def test_stop_strings_found_a_step_late_end_at_the_same_token(engines, monkeypatch):
    """Stop strings taken from the middle of each greedy completion: with overlap the stop is found while the next
    step runs; that step's token is dropped, so tokens, text and reason are those of the plain executor."""
    off, on = engines
    plain = off.generate(PROMPTS, SamplingParams(max_new_tokens=30, ignore_eos=True))
    stops = [c.text[len(c.text) // 2:len(c.text) // 2 + 3] for c in plain if len(c.text) > 8]
    assert stops
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=stops)
    counted = [llm.executor.totals["generated_tokens"] for llm in (off, on)]
    expected = _outcome(off, params)
    assert any(reason == "stop" for _, _, reason in expected)
    late, postprocess = [], on.executor._postprocess
    monkeypatch.setattr(on.executor, "_postprocess", lambda rows, **kw: late.extend(r for r in rows if r.seq.finished)
                        or postprocess(rows, **kw))
    assert _outcome(on, params) == expected
    assert late  # rows computed for a request whose stop string was found while they ran: dropped
    assert on.executor.totals["generated_tokens"] - counted[1] == off.executor.totals["generated_tokens"] - counted[0]


def test_speculation_with_stop_strings(engines):
    """n-gram verifies accept several tokens at once; a stop string inside them ends the request at the same token."""
    off, on = engines
    plain = off.generate(PROMPTS, SamplingParams(max_new_tokens=30, ignore_eos=True))
    stops = [c.text[-6:-3] for c in plain if len(c.text) > 8]
    for params in (SamplingParams(max_new_tokens=30, ignore_eos=True),
                   SamplingParams(max_new_tokens=30, ignore_eos=True, stop=stops)):
        assert _outcome(on, params, Speculation("ngram")) == _outcome(off, params, Speculation("ngram"))


def test_stream_events_are_the_same(engines):
    off, on = engines
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, stop=["\n\n"])
    events = [[(o.token_id, o.text) for o in llm.submit(PROMPTS[1], params)] for llm in (off, on)]
    assert events[0] == events[1] and events[0]


def test_cancel_and_shutdown_close_every_handle(trained_engine):
    llm = LLM(trained_engine, threads=1, overlap=True)
    handles = [llm.submit(p, SamplingParams(max_new_tokens=200, ignore_eos=True)) for p in PROMPTS]
    next(iter(handles[0]))
    handles[0].cancel()
    assert handles[0].result(timeout=30).finish_reason == "cancelled"
    llm.close()
    assert all(h.result(timeout=30).finish_reason in ("cancelled", "length") for h in handles)


def test_steps_run_ahead_give_the_same_tokens_as_one_step_at_a_time(trained_engine):
    """lookahead (multi-step): greedy and top-k rows run several decode steps back to back, each fed the last
    one's tokens; EOS, max_new_tokens inside a chain, stop strings and a request arriving mid-chain end a chain
    early. Same tokens, text and reasons as one step at a time (overlap on, lookahead 1)."""
    ahead, single = LLM(trained_engine, threads=1, overlap=True, lookahead=5), LLM(trained_engine, threads=1, overlap=True, lookahead=1)
    assert single.executor.lookahead == 1 and ahead.executor.lookahead == 5
    plain = single.generate(PROMPTS, SamplingParams(max_new_tokens=30, ignore_eos=True))
    stops = [c.text[len(c.text) // 2:len(c.text) // 2 + 3] for c in plain if len(c.text) > 8]
    cases = [[SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (7, 13, 22, 3)],  # lengths end inside chains
             SamplingParams(max_new_tokens=60),  # EOS may end a row
             SamplingParams(max_new_tokens=30, ignore_eos=True, stop=stops),
             SamplingParams(max_new_tokens=24, temperature=0.7, top_k=5, seed=3)]
    for params in cases:
        before = ahead.executor.totals["steps_run_ahead"]
        assert _outcome(ahead, params) == _outcome(single, params)
        assert ahead.executor.totals["steps_run_ahead"] > before  # chains ran
    assert single.executor.totals["steps_run_ahead"] == 0
    from runtime.serve.metrics import ServerMetrics

    ran = ahead.executor.stats()["steps_run_ahead"]
    assert f'engine_steps_run_ahead_total{{model="m"}} {float(ran)}' in ServerMetrics({"m": ahead}).render().decode()
    # a request that arrives while a chain runs: it ends the chain and gets its row; each stream as if alone
    first = ahead.submit(PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True))
    next(iter(first))
    later = ahead.submit(PROMPTS[1], SamplingParams(max_new_tokens=20, ignore_eos=True))
    expected = [single.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids
                for p, n in ((PROMPTS[0], 40), (PROMPTS[1], 20))]
    assert [first.result(timeout=60).token_ids, later.result(timeout=60).token_ids] == expected
    ahead.close(), single.close()


def test_repetition_penalty_rows_run_one_step_at_a_time(trained_engine):
    """Full-logits rows (here a repetition penalty) are sampled on the executor's thread from the history: no
    chain, and the same tokens."""
    llm = LLM(trained_engine, threads=1, overlap=True, lookahead=4)
    params = SamplingParams(max_new_tokens=16, repetition_penalty=1.3, ignore_eos=True)
    off = LLM(trained_engine, threads=1)
    assert _outcome(llm, params) == _outcome(off, params)
    assert llm.executor.totals["steps_run_ahead"] == 0
    llm.close(), off.close()


def test_lookahead_without_overlap_is_refused(trained_engine):
    with pytest.raises(ValueError, match="lookahead 4 needs overlap"):
        LLM(trained_engine, overlap=False, lookahead=4)
    with pytest.raises(ValueError, match="lookahead 4 needs overlap .*, which is off on cpu by default"):
        LLM(trained_engine, lookahead=4)


def test_cancel_and_shutdown_inside_a_chain(trained_engine):
    """A cancellation ends the chain it lands in (the request ends "cancelled", the others run on); closing the
    engine while chains run closes every handle."""
    llm = LLM(trained_engine, threads=1, overlap=True, lookahead=64)
    params = SamplingParams(max_new_tokens=300, ignore_eos=True)
    handles = [llm.submit(p, params) for p in PROMPTS]
    stream = iter(handles[1])
    for _ in range(5):
        next(stream)
    handles[1].cancel()
    assert handles[1].result(timeout=30).finish_reason == "cancelled"
    others = [h.result(timeout=60) for i, h in enumerate(handles) if i != 1]
    alone = LLM(trained_engine, threads=1)
    assert [c.token_ids for c in others] == [c.token_ids for c in alone.generate(
        [p for i, p in enumerate(PROMPTS) if i != 1], params)]
    assert llm.executor.totals["steps_run_ahead"] > 0
    handles = [llm.submit(p, params) for p in PROMPTS]
    next(iter(handles[0]))
    llm.close()
    assert all(h.result(timeout=30).finish_reason in ("cancelled", "length") for h in handles)
    alone.close()
