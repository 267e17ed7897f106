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
    monkeypatch.setattr(on.executor, "_postprocess", lambda rows: late.extend(r for r in rows if r.seq.finished)
                        or postprocess(rows))
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
