"""AsyncLLM: the asyncio form of the embeddable API, on the tiny test engine."""
from __future__ import annotations

import asyncio
import time

import pytest

from runtime.async_engine import AsyncLLM
from runtime.engine import LLM, RequestError
from runtime.request.params import SamplingParams


@pytest.fixture(scope="module")
def offline(tiny_engine):
    llm = LLM(tiny_engine)
    yield llm
    llm.close()


def run(tiny_engine, body):
    async def main():
        engine = await AsyncLLM.load(tiny_engine)
        try:
            return await body(engine)
        finally:
            await engine.close()
    return asyncio.run(main())


def test_concurrent_generate_and_stream_match_offline(tiny_engine, offline):
    prompts = ["hello", "the cat", "a b c", "world"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)

    async def body(engine):
        completions = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        streamed = "".join([t async for t in engine.stream(prompts[0], params)])
        return completions, streamed

    completions, streamed = run(tiny_engine, body)
    want = offline.generate(prompts, params)
    assert [c.token_ids for c in completions] == [w.token_ids for w in want]
    assert streamed == want[0].text


def test_cancelling_the_awaiting_task_cancels_the_request(tiny_engine):
    async def body(engine):
        decode = engine.llm.runner.decode  # a step of >= 1 ms: the 80 tokens cannot all be out before the cancel
        engine.llm.runner.decode = lambda *a, **k: (time.sleep(0.001), decode(*a, **k))[1]
        request = await engine.submit("hello", SamplingParams(max_new_tokens=80, ignore_eos=True))
        first = await request.__anext__()
        task = asyncio.create_task(request.result())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if (await engine.stats())["free_slots"] == engine.llm.spec.slots:
                break
            await asyncio.sleep(0.01)
        return first, request.handle, await engine.stats()

    first, handle, stats = run(tiny_engine, body)
    assert isinstance(first.token_id, int)
    assert handle.result(timeout=5).finish_reason == "cancelled"
    assert stats["running"] == 0 and stats["queue_depth"] == 0


def test_request_errors_before_any_work(tiny_engine):
    async def body(engine):
        with pytest.raises(RequestError, match="max_seq_len"):
            await engine.submit("hello", SamplingParams(max_new_tokens=10_000))
        return await engine.stats()

    assert run(tiny_engine, body)["steps"] == 0


def test_the_loop_wakes_once_per_step_not_once_per_token(tiny_engine, offline):
    prompts = ["hello", "the cat", "a b c", "world"]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)

    async def body(engine):
        loop, wakeups = asyncio.get_running_loop(), []
        schedule = loop.call_soon_threadsafe

        def counted(callback, *args):
            wakeups.append(callback)
            return schedule(callback, *args)

        loop.call_soon_threadsafe = counted
        try:
            completions = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        finally:
            del loop.call_soon_threadsafe
        return completions, len(wakeups), (await engine.stats())["steps"]

    completions, wakeups, steps = run(tiny_engine, body)
    assert [c.token_ids for c in completions] == [w.token_ids for w in offline.generate(prompts, params)]
    events = len(prompts) * (16 + 1)  # every token, and each request's end
    assert wakeups <= steps + len(prompts) < events  # a step's events share a wake-up
