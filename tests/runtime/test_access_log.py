"""engine-serve's access log (#23): one INFO line per request with method, path, status, generated tokens and
latency, for plain and streamed answers and for refusals."""
from __future__ import annotations

import logging
import re
import time

import httpx
import pytest


@pytest.fixture(scope="module")
def server(trained_server):
    return trained_server


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "engine-serve" and r.levelno == logging.INFO]


def settled_lines(caplog, expected: int, within_s: float = 5.0) -> list[str]:
    """The access lines once `expected` are there: a line is written after its response has gone out, so the
    client can read the answer a moment before the server thread logs it."""
    deadline = time.monotonic() + within_s
    while len(access_lines(caplog)) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return access_lines(caplog)


def test_one_line_per_request_with_status_tokens_and_latency(server, caplog):
    caplog.set_level(logging.INFO, logger="engine-serve")
    body = {"model": "trained", "prompt": "def f(", "max_tokens": 5, "ignore_eos": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True, "n": 2}, timeout=60) as r:
        assert r.status_code == 200 and r.read()
    assert httpx.post(f"{server.url}/v1/completions", json=body | {"max_tokens": -1}, timeout=60).status_code == 400
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    lines = settled_lines(caplog, 4)
    assert len(lines) == 4, lines
    pattern = r'127\.0\.0\.1 "(POST|GET) (/v1/completions|/health)" (\d{3}) tokens=(\d+|-) \d+\.\d{3}s'
    parsed = [re.fullmatch(pattern, line).groups() for line in lines]
    assert [(m, s, t) for m, _, s, t in parsed] == [("POST", "200", "5"), ("POST", "200", "10"), ("POST", "400", "-"),
                                                    ("GET", "200", "-")]
