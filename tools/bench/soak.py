"""Soak and load test of engine-serve: N concurrent streaming clients for a bounded time against a
server this tool starts on 127.0.0.1, and the offline executor at the same concurrency.

Every stream is greedy and compared with the offline answer to its prompt (text and token count):
a lost or duplicated token shows as a mismatch. Reports server RSS growth from the first to the last
minute, p50/p99 TTFT and TPOT, requests/s and tokens/s, and plots them over time (PNG). The offline
executor runs half before and half after the server phase. CPU seconds per generated token are reported
for the server process and its event loop thread alone, the clients (this process: one asyncio loop over
lean h11 connections, tools/bench/sse_client.py) and the offline executor: all of them share the cores,
and CPU per token, unlike tokens/s, holds up on a machine shared with other work.

    python -m tools.bench.soak [--engine DIR] [--clients 32] [--duration 600] [--threads N] [--out DIR]
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click
import httpx
import numpy as np

from tools.bench.sse_client import SSEConnection, StreamError

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"{head}{tail}" for head in ("def ", "class ", "import ", "for ", "if ", "return ", "with ", "# ")
           for tail in ("main(", "os\n", "self.", "x in ", "data", "path(", "value = ", "Error")]


@dataclass
class Sample:
    """One finished stream."""

    sent: float       # seconds since the run's start
    done: float
    ttft: float
    tpot: float | None
    tokens: int
    ok: bool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds of a process so far, or of one of its threads."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build_trained(out: Path) -> Path:
    recipe = ROOT / "build_recipes" / "trained_cpu.yaml"
    subprocess.run([sys.executable, "-m", "builder.cli", "--recipe", str(recipe), "--out", str(out),
                    "--set", f"model={ROOT / 'checkpoints' / 'trained' / 'target'}"], check=True,
                   stdout=subprocess.DEVNULL)
    return out


def expected(engine: Path, max_tokens: int, threads: int | None = None) -> dict[str, tuple[str, int]]:
    """Offline greedy answer (text, token count) for every prompt."""
    from runtime.engine import LLM
    from runtime.request.params import SamplingParams

    llm = LLM(engine, threads=threads)
    try:
        done = llm.generate(PROMPTS, SamplingParams(max_new_tokens=max_tokens))
        return {p: (c.text, len(c.token_ids)) for p, c in zip(PROMPTS, done)}
    finally:
        llm.close()


async def _client(url: str, index: int, deadline: float, start: float, max_tokens: int,
                  want: dict, samples: list[Sample], failures: list[tuple[float, str]]) -> None:
    """One closed-loop client on a keep-alive connection of its own."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = SSEConnection(host, int(port))
    body = {"model": "soak", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    n = index
    while time.perf_counter() < deadline:
        prompt = PROMPTS[n % len(PROMPTS)]
        n += 1
        sent = time.perf_counter()
        first = last = None
        text, tokens = [], None
        try:
            async for data in connection.post("/v1/completions", json.dumps({**body, "prompt": prompt}).encode()):
                if data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    last = time.perf_counter()
                    first = first or last
                    text.append(chunk["choices"][0]["text"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        except StreamError as err:  # counted and reported; the client goes on with a new request
            failures.append((time.perf_counter() - start, str(err)))
            continue
        ok = ("".join(text), tokens) == want[prompt]
        tpot = (last - first) / (tokens - 1) if tokens and tokens > 1 and first else None
        samples.append(Sample(sent - start, time.perf_counter() - start, (first or sent) - sent, tpot, tokens or 0, ok))
    connection.close()


async def _load(url: str, clients: int, duration: float, max_tokens: int, want: dict) -> tuple[list, list, float]:
    samples: list[Sample] = []
    failures: list[tuple[float, str]] = []
    start = time.perf_counter()
    await asyncio.gather(*(_client(url, i, start + duration, start, max_tokens, want, samples, failures)
                           for i in range(clients)))
    return samples, failures, time.perf_counter() - start


def serve_and_load(engine: Path, clients: int, duration: float, max_tokens: int, want: dict,
                   threads: int | None = None) -> dict:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve.app", "--engine", f"soak={engine}", "--port",
                             str(port), "--max-concurrency", str(2 * clients)] +
                            ([] if threads is None else ["--threads", str(threads)]), env={**os.environ})
    url, rss, stop = f"http://127.0.0.1:{port}", [], threading.Event()
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("engine-serve did not come up")
            time.sleep(0.2)

        def watch(start=time.perf_counter()):
            while not stop.wait(2.0):
                rss.append((time.perf_counter() - start, _rss_mb(proc.pid)))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        cpu = {"server": -_cpu_s(proc.pid), "server_loop": -_cpu_s(proc.pid, proc.pid), "clients": -time.process_time()}
        samples, failures, wall = asyncio.run(_load(url, clients, duration, max_tokens, want))
        cpu = {"server": cpu["server"] + _cpu_s(proc.pid), "clients": cpu["clients"] + time.process_time(),
               "server_loop": cpu["server_loop"] + _cpu_s(proc.pid, proc.pid)}  # its main thread: the event loop
        stop.set()
        watcher.join()
        server_metrics = httpx.get(f"{url}/metrics").text
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    statuses = {line.split('status="')[1].split('"')[0]: float(line.split()[-1])
                for line in server_metrics.splitlines() if line.startswith("engine_requests_total{")}
    return {"samples": samples, "failures": failures, "wall_s": wall, "rss": rss, "server_statuses": statuses,
            "server_alive_at_end": alive, "cpu_s": cpu}


def offline_load(engine: Path, clients: int, duration: float, max_tokens: int, threads: int | None = None) -> dict:
    """The executor in-process, `clients` closed-loop threads: generated tokens/s and CPU seconds."""
    from runtime.engine import LLM
    from runtime.request.params import SamplingParams

    llm, params, counts = LLM(engine, threads=threads), SamplingParams(max_new_tokens=max_tokens), []
    start, cpu = time.perf_counter(), time.process_time()

    def client(i: int) -> None:
        while time.perf_counter() - start < duration:
            c = llm.submit(PROMPTS[i % len(PROMPTS)], params).result()
            counts.append(len(c.token_ids))
            i += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    llm.close()
    return {"requests": len(counts), "tokens": sum(counts), "wall_s": wall, "tok_s": sum(counts) / wall,
            "req_s": len(counts) / wall, "cpu_us_per_token": 1e6 * cpu / max(1, sum(counts))}


def summarize(run: dict, offline_runs: list[dict]) -> dict:
    """`offline_runs`: the offline executor before and after the server phase; the server is compared with
    their mean (a load that drifts during the run moves both sides)."""
    samples, rss, wall = run["samples"], run["rss"], run["wall_s"]
    offline_tok_s = float(np.mean([o["tok_s"] for o in offline_runs]))
    minute = min(60.0, wall / 5)
    first = [m for t, m in rss if t <= minute]
    last = [m for t, m in rss if t >= wall - minute]
    ttft = [s.ttft for s in samples]
    tpot = [s.tpot for s in samples if s.tpot is not None]
    tokens = sum(s.tokens for s in samples)
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else None  # noqa: E731  (ms)
    return {"requests": len(samples), "mismatched_streams": sum(not s.ok for s in samples),
            "failed_requests": len(run["failures"]), "failures": run["failures"][:20],
            "server_alive_at_end": run["server_alive_at_end"], "wall_s": wall,
            "req_s": len(samples) / wall, "tok_s": tokens / wall, "generated_tokens": tokens,
            "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
            "tpot_ms": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
            "rss_mb": {"first_window": float(np.mean(first)), "last_window": float(np.mean(last)),
                       "window_s": minute, "growth_pct": 100 * (np.mean(last) / np.mean(first) - 1)},
            "server_statuses": run["server_statuses"],
            "offline": {"tok_s": offline_tok_s, "runs": offline_runs},
            "server_vs_offline_tok_s": tokens / wall / offline_tok_s,
            "cpu_us_per_token": {**{k: 1e6 * v / max(1, tokens) for k, v in run["cpu_s"].items()},
                                 "offline": float(np.mean([o["cpu_us_per_token"] for o in offline_runs]))}}


def plot(run: dict, path: Path, bucket: float = 10.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = run["samples"]
    edges = np.arange(0, run["wall_s"] + bucket, bucket)
    mids, tok, ttft50, ttft99, tpot50, tpot99 = [], [], [], [], [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = [s for s in samples if lo <= s.done < hi]
        if not inside:
            continue
        mids.append((lo + hi) / 2)
        tok.append(sum(s.tokens for s in inside) / (min(hi, run["wall_s"]) - lo))
        ttft50.append(np.percentile([s.ttft for s in inside], 50) * 1000)
        ttft99.append(np.percentile([s.ttft for s in inside], 99) * 1000)
        tp = [s.tpot for s in inside if s.tpot is not None] or [float("nan")]
        tpot50.append(np.percentile(tp, 50) * 1000)
        tpot99.append(np.percentile(tp, 99) * 1000)
    fig, ax = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax[0, 0].plot(mids, tok)
    ax[0, 0].set_ylabel("generated tokens/s (streams ended)")
    ax[0, 1].plot(*zip(*run["rss"]))
    ax[0, 1].set_ylabel("server RSS (MiB)")
    ax[1, 0].plot(mids, ttft50, label="p50")
    ax[1, 0].plot(mids, ttft99, label="p99")
    ax[1, 0].set_ylabel("TTFT (ms)")
    ax[1, 1].plot(mids, tpot50, label="p50")
    ax[1, 1].plot(mids, tpot99, label="p99")
    ax[1, 1].set_ylabel("TPOT (ms)")
    for a in ax.flat:
        a.grid(alpha=0.3)
    for a in ax[1]:
        a.set_xlabel("seconds")
        a.legend()
    fig.suptitle(f"engine-serve soak: {len(samples)} streams")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


@click.command()
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Engine directory (default: build the trained CPU engine into a temporary directory).")
@click.option("--clients", default=32, show_default=True, type=click.IntRange(1, 512))
@click.option("--duration", default=600.0, show_default=True, type=click.FloatRange(5, 3600),
              help="Seconds of load against the server.")
@click.option("--offline-duration", default=None, type=click.FloatRange(5, 3600),
              help="Seconds of the offline executor, half before and half after the server phase "
                   "(default: duration / 5, at least 30).")
@click.option("--threads", default=None, type=click.IntRange(1),
              help="ONNX Runtime threads of both the server and the offline executor (default: all cores).")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1, 512))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("soak_results"),
              show_default=True, help="Where soak.json and soak.png go.")
def main(engine, clients, duration, offline_duration, max_tokens, threads, out):
    """Soak engine-serve with streaming clients and compare it with the offline executor."""
    from tools.bench.env import environment, load_average

    out.mkdir(parents=True, exist_ok=True)
    env = environment()  # CPU, vector extensions, cores, versions, load at the start
    with tempfile.TemporaryDirectory() as tmp:
        engine = engine or build_trained(Path(tmp) / "trained")
        want = expected(engine, max_tokens, threads)
        half = (offline_duration or max(30.0, duration / 5)) / 2
        offline = [offline_load(engine, clients, half, max_tokens, threads)]
        run = serve_and_load(engine, clients, duration, max_tokens, want, threads)
        offline.append(offline_load(engine, clients, half, max_tokens, threads))
    result = {**summarize(run, offline), "threads": threads, "environment": env,
              "load_average_at_end": load_average()}
    plot(run, out / "soak.png")
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    click.echo(json.dumps(result, indent=2))
    if result["mismatched_streams"] or result["failed_requests"]:
        raise SystemExit(f"{result['mismatched_streams']} streams differ from the offline answers, "
                         f"{result['failed_requests']} requests failed")


if __name__ == "__main__":
    main()
