"""The longer hostile-client suite for engine-serve (issue 26; CI runs the short one,
tests/runtime/test_server_hostile.py): a server this tool starts on 127.0.0.1 with an API key takes rounds
of malformed bodies, field abuse, auth probes, disconnect storms, slowloris connections and clients that
stop reading, then SIGTERM under that load. Each case checks its documented status; throughout, /health
must answer, the server's RSS is sampled, and every log line is counted (one per dropped client, no
tracebacks). Traffic goes to 127.0.0.1 only, in bounded loops (--rounds, at most 20).

    python -m tools.bench.hostile [--engine DIR] [--rounds 3] [--out DIR]
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
import httpx

from tools.bench.soak import _free_port, _rss_mb, build_trained

KEY = "hostile-suite-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
MODEL = "hostile"
# (name, path, raw body, extra headers, expected status): every one answered before any generation
MALFORMED = [
    ("not json", "/v1/completions", b"{nope", {}, 400),
    ("NaN literal", "/v1/completions", b'{"model": "hostile", "prompt": "x", "temperature": NaN}', {}, 400),
    ("Infinity literal", "/v1/completions", b'{"model": "hostile", "prompt": "x", "top_p": Infinity}', {}, 400),
    ("array body", "/v1/completions", b"[1, 2, 3]", {}, 400),
    ("prompt wrong type", "/v1/completions", b'{"model": "hostile", "prompt": {"a": 1}}', {}, 400),
    ("token id out of vocab", "/v1/completions", b'{"model": "hostile", "prompt": [99999999]}', {}, 400),
    ("chat text a number", "/v1/chat/completions",
     b'{"model": "hostile", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', {}, 400),
    ("chat text null", "/v1/chat/completions",
     b'{"model": "hostile", "messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]}', {}, 400),
    ("chat no messages", "/v1/chat/completions", b'{"model": "hostile", "messages": []}', {}, 400),
    ("text/plain body", "/v1/completions", b'{"model": "hostile", "prompt": "x"}', {"Content-Type": "text/plain"}, 415),
    ("form body", "/v1/completions", b"model=hostile&prompt=x",
     {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("foreign Host", "/v1/completions", b'{"model": "hostile", "prompt": "x"}', {"Host": "evil.example"}, 400),
    ("unknown model, long", "/v1/completions", json.dumps({"model": "m" * 100_000, "prompt": "x"}).encode(), {}, 404),
]
FIELD_ABUSE = [
    ("20,000 prompts x n=16", {"prompt": ["x"] * 20_000, "n": 16, "max_tokens": 1}, 429),
    ("900 KB text prompt", {"prompt": "word " * 180_000}, 400),
    ("max_tokens over the context", {"prompt": "x", "max_tokens": 10**9}, 400),
    ("temperature out of range", {"prompt": "x", "temperature": 5}, 400),
    ("repetition_penalty 1e308", {"prompt": "x", "repetition_penalty": 1e308}, 400),
    ("logit_bias", {"prompt": "x", "logit_bias": {"1": 100}}, 400),
    ("best_of", {"prompt": "x", "best_of": 4}, 400),
    ("suffix", {"prompt": "x", "suffix": "}"}, 400),
    ("logprobs 0", {"prompt": "x", "logprobs": 0}, 400),
    ("n over 16", {"prompt": "x", "n": 1000}, 400),
]
LONG = {"model": MODEL, "prompt": "x", "max_tokens": 900, "ignore_eos": True}


class Server:
    """engine-serve in a subprocess on 127.0.0.1, its stderr collected, its RSS and /health watched."""

    def __init__(self, engine: Path, **flags):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.serve.app", "--engine", f"{MODEL}={engine}",
                                      "--port", str(self.port), "--api-key", KEY, *args],
                                     stderr=subprocess.PIPE, text=True, env={**os.environ})
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 120
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine-serve did not come up: {''.join(self.log)[-2000:]}")
            time.sleep(0.2)
        self.rss, self.health_failures, self._stop = [], 0, threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _watch(self) -> None:
        while not self._stop.wait(0.5) and self.proc.poll() is None:
            self.rss.append(_rss_mb(self.proc.pid))
            self.health_failures += not self.healthy()

    def slots_used(self) -> float:
        text = httpx.get(f"{self.url}/metrics", headers=AUTH, timeout=5).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("engine_kv_slots_used{"))

    def terminate(self, timeout: float = 30) -> float:
        """SIGTERM; seconds until the process exited (inf: killed after `timeout`)."""
        self._stop.set()
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
            return time.monotonic() - start
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return float("inf")


def raw_request(path: str, body: bytes, headers: dict | None = None) -> bytes:
    head = {"Host": "127.0.0.1", **AUTH, **(headers or {}), "Content-Length": str(len(body))}
    return f"POST {path} HTTP/1.1\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + \
        b"\r\n" + body


def connect(server: Server, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect(("127.0.0.1", server.port))
    return s


def expect(results: list, case: str, got, want, seconds: float | None = None) -> None:
    results.append({"case": case, "got": got, "want": want, "ok": got == want,
                    **({"seconds": round(seconds, 3)} if seconds is not None else {})})


def bodies(server: Server, results: list) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, path, body, headers, status in MALFORMED:
            start = time.perf_counter()
            r = http.post(path, content=body, headers={**AUTH, **headers})
            expect(results, name, r.status_code, status, time.perf_counter() - start)
        for name, fields, status in FIELD_ABUSE:
            start = time.perf_counter()
            r = http.post("/v1/completions", json={"model": MODEL, **fields}, headers=AUTH)
            expect(results, name, r.status_code, status, time.perf_counter() - start)
        for route in ("/v1/models", "/version", "/metrics"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                expect(results, f"auth {route} {sorted(headers.values())}", http.get(route, headers=headers).status_code, 401)
        expect(results, "HEAD /health", http.head("/health").status_code, 200)
        expect(results, "404 shape", sorted(http.get("/nothing", headers=AUTH).json()["error"]), ["code", "message", "param", "type"])


def storm(server: Server, results: list, clients: int) -> None:
    """Clients that vanish: mid-body, while waiting for an answer, and mid-stream; capacity comes back."""
    body = json.dumps(LONG).encode()
    stream = json.dumps({**LONG, "stream": True}).encode()
    for i in range(clients):
        s = connect(server)
        request = [raw_request("/v1/completions", body)[:-5], raw_request("/v1/completions", body),
                   raw_request("/v1/completions", stream)][i % 3]
        s.sendall(request)
        if i % 3 == 2:
            s.recv(4096)  # the first chunk
        time.sleep(0.3)
        s.close()
    deadline = time.monotonic() + 30
    while server.slots_used() and time.monotonic() < deadline:
        time.sleep(0.2)
    expect(results, f"{clients} dropped clients: KV slots in use after", server.slots_used(), 0.0)


def slowloris(server: Server, results: list, connections: int, header_timeout: float) -> None:
    sockets = [connect(server) for _ in range(connections)]
    for i, s in enumerate(sockets):
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" if i % 2 else b"")
    start = time.monotonic()
    closed = sum(s.recv(100) == b"" for s in sockets)
    for s in sockets:
        s.close()
    expect(results, f"{connections} slowloris connections closed", closed, connections, time.monotonic() - start)
    expect(results, "closed within the header timeout + 2 s", time.monotonic() - start < header_timeout + 2, True)


def slow_readers_then_sigterm(server: Server, results: list, readers: int, shutdown_timeout: float) -> None:
    stream = json.dumps({**LONG, "n": 8, "stream": True}).encode()
    sockets = [connect(server, rcvbuf=4096) for _ in range(readers)]
    for s in sockets:
        s.sendall(raw_request("/v1/completions", stream))
    time.sleep(2)
    expect(results, f"/health with {readers} clients not reading", server.healthy(), True)
    seconds = server.terminate()
    expect(results, "exits after SIGTERM within the shutdown timeout + 5 s", seconds < shutdown_timeout + 5, True,
           seconds)
    for s in sockets:
        s.close()


def run(engine: Path, rounds: int) -> dict:
    flags = {"header_timeout": 2, "body_timeout": 5, "shutdown_timeout": 5, "max_concurrency": 32}
    server, results = Server(engine, **flags), []
    try:
        rss_start = _rss_mb(server.proc.pid)
        for _ in range(rounds):
            bodies(server, results)
            storm(server, results, clients=12)
            slowloris(server, results, connections=40, header_timeout=flags["header_timeout"])
        rss_before_shutdown = _rss_mb(server.proc.pid)
        slow_readers_then_sigterm(server, results, readers=4, shutdown_timeout=flags["shutdown_timeout"])
    finally:
        if server.proc.poll() is None:
            server.terminate(timeout=5)
    time.sleep(0.5)  # the stderr reader takes the last lines
    log = "".join(server.log)
    return {"cases": len(results), "failed": [r for r in results if not r["ok"]], "results": results,
            "health_failures": server.health_failures, "rss_mb": {"start": rss_start, "end": rss_before_shutdown,
                                                                 "max": max(server.rss, default=None)},
            "log_lines": len(log.splitlines()), "tracebacks": log.count("Traceback"), "log_tail": log[-3000:]}


@click.command()
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Engine directory (default: build the trained CPU engine into a temporary directory).")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 20))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("hostile_results"),
              show_default=True, help="Where hostile.json goes.")
def main(engine, rounds, out):
    """Hostile and careless clients against engine-serve on 127.0.0.1."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(engine or build_trained(Path(tmp) / "trained"), rounds)
    (out / "hostile.json").write_text(json.dumps(result, indent=2))
    click.echo(json.dumps({k: v for k, v in result.items() if k != "results"}, indent=2))
    if result["failed"] or result["health_failures"] or result["tracebacks"]:
        raise SystemExit(f"{len(result['failed'])} cases failed, /health failed {result['health_failures']} times, "
                         f"{result['tracebacks']} tracebacks in the log")


if __name__ == "__main__":
    main()
