"""The soak's lean streaming client against a live engine-serve on the tiny engine: events exact over one
kept-alive connection, a refused request a StreamError, the connection usable after it."""
from __future__ import annotations

import asyncio
import json

import pytest

from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.serve.app import RunningServer, create_app
from tools.bench.sse_client import SSEConnection, StreamError


@pytest.fixture(scope="module")
def served(tiny_engine):
    llm = LLM(tiny_engine)
    server = RunningServer(create_app({"tiny": llm}))
    yield server, llm
    server.stop()
    llm.close()


async def _texts(connection: SSEConnection, body: dict) -> tuple[str, list[bytes]]:
    data = [d async for d in connection.post("/v1/completions", json.dumps(body).encode())]
    return "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1] if json.loads(d)["choices"]), data


def test_streams_on_one_connection_match_offline_and_errors_are_stream_errors(served):
    server, llm = served
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}

    async def run():
        connection = SSEConnection(host, int(port))
        try:
            first = await _texts(connection, {**body, "prompt": "hello"})
            writer = connection._writer
            second = await _texts(connection, {**body, "prompt": "the cat"})
            assert connection._writer is writer  # kept alive
            with pytest.raises(StreamError, match="HTTP 404"):
                await _texts(connection, {**body, "model": "nope", "prompt": "x"})
            third = await _texts(connection, {**body, "prompt": "hello"})  # a new connection after the error
            return first, second, third
        finally:
            connection.close()

    first, second, third = asyncio.run(run())
    want = llm.generate(["hello", "the cat"], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [first[0], second[0], third[0]] == [want[0].text, want[1].text, want[0].text]
    assert first[1][-1] == b"[DONE]"
