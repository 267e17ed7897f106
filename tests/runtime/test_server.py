"""engine-serve against the official `openai` client: a live server on 127.0.0.1 (ephemeral port)
serving the trained engine and the tiny test engine by name; every greedy answer is compared with
the offline LLM's answer to the same request alone."""
from __future__ import annotations

import asyncio
import re
import time
from contextlib import closing

import httpx
import openai
import pytest

from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.serve.app import RunningServer, ServeLimits, create_app

KEY = "test-key"
PROMPTS = ["def main(", "import os\n", "class Foo:\n    ", "for i in range(", "return self.", "    if not ",
           "# Copyright", "while True:\n", "try:\n    import ", "x = [", "def __init__(self", "raise ValueError(",
           "with open(", "from . import ", "print(", "lambda x: "]


@pytest.fixture(scope="module")
def engines(trained_engine, tiny_engine):
    loaded = {"trained": LLM(trained_engine), "tiny": LLM(tiny_engine)}
    yield loaded
    for llm in loaded.values():
        llm.close()


@pytest.fixture(scope="module")
def offline(trained_engine):
    llm = LLM(trained_engine)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(engines):
    running = RunningServer(create_app(engines, api_key=KEY, limits=ServeLimits(max_body_bytes=64 * 1024)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def metric(server, name: str, **labels) -> float:
    """One sample from /metrics (0 when absent)."""
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return 0.0


def alone(llm: LLM, prompt: str, **params) -> str:
    return llm.generate([prompt], SamplingParams(**params))[0].text


def test_models_health_version(server, client):
    assert sorted(m.id for m in client.models.list().data) == ["tiny", "trained"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version", headers={"Authorization": f"Bearer {KEY}"}).json()["models"] == [
        "tiny", "trained"]


def test_completion_matches_offline(client, offline):
    r = client.completions.create(model="trained", prompt="def main(", max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == alone(offline, "def main(", max_new_tokens=24)
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(offline.encode("def main("))


def test_completion_stream_with_usage_and_stop(client, offline):
    stream = client.completions.create(model="trained", prompt="import os\n", max_tokens=40, temperature=0,
                                       stop=["\n"], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == alone(offline, "import os\n", max_new_tokens=40, stop=("\n",)) and "\n" not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_chat_stream_and_not(client, offline):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    prompt = offline.apply_chat_template(messages)
    want = alone(offline, prompt, max_new_tokens=16)
    r = client.chat.completions.create(model="trained", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    chunks = list(client.chat.completions.create(model="trained", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_and_seed(client):
    greedy = client.completions.create(model="trained", prompt="x = [", max_tokens=8, temperature=0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1] and greedy.choices[0].text == greedy.choices[1].text
    assert greedy.usage.completion_tokens == 16
    seeded = [client.completions.create(model="trained", prompt="x = [", max_tokens=12, temperature=1.0, seed=7,
                                        n=2).choices for _ in range(2)]
    assert [c.text for c in seeded[0]] == [c.text for c in seeded[1]]  # same seed, same choices


def test_stream_of_several_choices_equals_the_whole_answer(client):
    """Events coalesced per write still give every choice its exact text, one finish each, exact usage."""
    ask = dict(model="trained", prompt=["def main(", "x = ["], n=2, max_tokens=20, temperature=0)
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts, finishes = ["" for _ in whole.choices], [[] for _ in whole.choices]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finishes[choice.index] += [choice.finish_reason] if choice.finish_reason else []
    assert texts == [c.text for c in whole.choices] and finishes == [[c.finish_reason] for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_sixteen_concurrent_greedy_streams_match_offline(server, offline):
    async def one(client, prompt):
        stream = await client.completions.create(model="trained", prompt=prompt, max_tokens=32, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    got = asyncio.run(run())
    assert got == [alone(offline, p, max_new_tokens=32) for p in PROMPTS]


def test_disconnect_mid_stream_frees_the_slot(server, client):
    cancelled = metric(server, "engine_requests_total", model="trained", status="cancelled")
    stream = client.completions.create(model="trained", prompt="def main(", max_tokens=900, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), stream):
        pass
    assert metric(server, "engine_kv_slots_used", model="trained") == 1
    stream.close()
    deadline = time.monotonic() + 10
    while metric(server, "engine_kv_slots_used", model="trained") != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(server, "engine_kv_slots_used", model="trained") == 0
    while metric(server, "engine_requests_total", model="trained", status="cancelled") == cancelled:
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "top_p": "high"}, 400, "top_p"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),  # at most 20 alternatives
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "max_tokens": 2000}, 400, "max_tokens"),  # prompt + max_tokens over max_seq_len 1024
    ({"prompt": "def f():\n    pass\n" * 300, "max_tokens": 1}, 400, "prompt"),  # over max_seq_len
    ({"prompt": "x", "model": "nope"}, 404, "model"),
    ({"model": "trained"}, 400, "prompt"),
])
def test_bad_requests_name_the_field(server, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "trained", **body}, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert "max_new_tokens" not in error["message"] and "load the engine" not in error["message"]  # HTTP's terms


def test_unknown_fields_ignored_and_limits(server, client, offline):
    r = client.completions.create(model="trained", prompt="print(", max_tokens=4, temperature=0,
                                  extra_body={"not_an_openai_field": {"x": 1}})
    assert r.choices[0].text == alone(offline, "print(", max_new_tokens=4)
    rejected = metric(server, "engine_requests_total", model="trained", status="rejected")
    with pytest.raises(openai.BadRequestError, match="max_seq_len"):
        client.completions.create(model="trained", prompt="x", max_tokens=5000)
    assert metric(server, "engine_requests_total", model="trained", status="rejected") == rejected + 1
    big = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "trained", "prompt": "x" * 70_000})
    assert big.status_code == 413 and "exceeds" in big.json()["error"]["message"]


def test_auth(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="trained", prompt="x", max_tokens=1)


def test_two_engines_by_name(client, engines, tiny_engine):
    with closing(LLM(tiny_engine)) as tiny:
        want = alone(tiny, "hello", max_new_tokens=6)
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0)
    assert got.model == "tiny" and got.choices[0].text == want
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "tiny" and chat.usage.completion_tokens <= 4


def test_concurrency_limit_answers_429(engines):
    running = RunningServer(create_app(engines, limits=ServeLimits(max_concurrency=1)))
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="trained", prompt="x", max_tokens=500, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="trained", prompt="x", max_tokens=1)
        stream.close()
    finally:
        running.stop()



def test_speculation_per_request_is_lossless_and_counted(server, client, offline):
    prompt = "def f(x):\n    return x\n\ndef f(x):\n    return x\n\ndef f("
    r = client.completions.create(model="trained", prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"speculation": "ngram"})
    assert r.choices[0].text == alone(offline, prompt, max_new_tokens=24)
    deadline = time.monotonic() + 10  # counted once it ends (its drafts may be 0: drafting that does not pay pauses)
    while 'engine_spec_accepted_tokens_total{model="trained"}' not in httpx.get(
            f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text:
        assert time.monotonic() < deadline, "the speculative request was not counted"
        time.sleep(0.02)
    with pytest.raises(openai.BadRequestError, match="draft") as err:  # this engine has no draft model
        client.completions.create(model="trained", prompt="x", max_tokens=2, extra_body={"speculation": "draft"})
    assert err.value.body["param"] == "speculation"
