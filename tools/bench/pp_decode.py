"""Pipeline parallelism against one process: batch decode tokens/s, time to first token at batch 1, and each
process's peak resident memory, engines side by side.

    flock /tmp/bench.lock python -m tools.bench.pp_decode \\
        --engine engines/smollm2-pp1 --threads 1 --engine engines/smollm2-pp1 --threads 2 \\
        --engine engines/smollm2-pp2 --threads 1 --rounds 3

`--threads`: ONNX Runtime threads per process (per stage for a pipeline engine), once per `--engine`. Every
engine of every round runs in a fresh process (rounds alternate the order: A B C, then C B A, ...), which
loads it once, warms up, then times `--runs` greedy generations of `--batch` prompts of `--prompt-tokens`
(decode tok/s: the tokens after each row's first over the time after the last row's first token) and
`--runs` batch-1 generations (time to first token). Peak RSS: the loading process's (rank 0, which for a
pipeline engine holds no layers) and each stage process's (VmHWM, read before the stages stop). Each stage's
seconds waiting for rank 0's steps, for the hidden states, computing and sending, over the whole load."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from tools.bench.env import load_average, machine
from tools.bench.isolated import run as run_isolated


def measure(engine_dir: str, threads: int, batch: int, prompt_tokens: int, new_tokens: int, runs: int,
            micro_batches: int | None = None, overlap: bool | None = None) -> dict:
    """Load once, warm up, time `runs` generations at `batch` and at batch 1 (first token); a pipeline engine
    with `micro_batches` in flight (None: one per stage), the executors with `overlap` (None: the default)."""
    from runtime.engine import LLM
    from runtime.parallel.rank import TRACE_ENV

    prompts = np.random.default_rng(0).integers(4, 1000, (batch, prompt_tokens))
    with tempfile.TemporaryDirectory() as trace:
        os.environ[TRACE_ENV] = trace  # the stages write where their time went when they stop
        try:
            llm = LLM(engine_dir, max_batch_size=batch, threads=threads, micro_batches=micro_batches, overlap=overlap)
        finally:
            del os.environ[TRACE_ENV]
        result = _timed(llm, prompts, new_tokens, runs)
        result["stage_seconds"] = [json.loads(f.read_text()) for f in sorted(Path(trace).glob("stage*.json"))]
    return {"engine": engine_dir, "threads": threads, "micro_batches": micro_batches, "overlap": overlap} | result


def _timed(llm, prompts, new_tokens: int, runs: int) -> dict:
    from tools.bench.measure import decode_tok_s, timed_generate

    try:
        timed_generate(llm, prompts, 4)  # binds the call shapes
        timings = [timed_generate(llm, prompts, new_tokens) for _ in range(runs)]
        timed_generate(llm, prompts[:1], 2)
        first = [timed_generate(llm, prompts[:1], 2).first_token_s for _ in range(runs)]
        stages = [_peak_mb(w.pid) for w in getattr(llm.runner, "workers", [])]
        overlap = getattr(llm.runner, "calls_in_flight_max", 1)
    finally:
        llm.close()
    rates = [decode_tok_s(len(prompts), new_tokens, t) for t in timings]
    return {"stages": max(1, len(stages)), "decode_tok_s": round(statistics.median(rates), 2),
            "runs": [round(r, 2) for r in rates], "ttft_ms": round(1e3 * statistics.median(first), 2), "stage_peak_rss_mb": stages,
            "calls_in_flight_max": overlap, "tokens": timings[0].token_ids}


def _peak_mb(pid: int) -> float:
    """A live process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def side_by_side(engines: list[str], threads: list[int], micro: list[int | None], overlap: list[bool | None],
                 rounds: int, **options) -> dict:
    from tools.bench import pp_decode  # `measure` by its module's name, also when this file runs as __main__

    slots, measured = list(enumerate(zip(engines, threads, micro, overlap))), []
    for number in range(rounds):
        for slot, (engine, n, m, o) in slots if number % 2 == 0 else slots[::-1]:
            click.echo(f"round {number + 1}/{rounds}: {engine} (threads {n}, micro-batches {m}, overlap {o})", err=True)
            result, process = run_isolated(pp_decode.measure, engine, n, options["batch"], options["prompt_tokens"],
                                           options["new_tokens"], options["runs"], m, o)
            measured.append({"round": number + 1, "slot": slot, "rank0_peak_rss_mb": round(process["peak_rss_mb"], 1)}
                            | result)
    tokens = [m.pop("tokens") for m in measured]
    summary = []
    for slot, (engine, n, micro_batches, overlaps) in slots:
        mine = [m for m in measured if m["slot"] == slot]
        summary.append({"engine": engine, "stages": mine[0]["stages"], "threads": n, "micro_batches": micro_batches,
                        "overlap": overlaps,
                        "decode_tok_s_median": round(statistics.median(r for m in mine for r in m["runs"]), 2),
                        "decode_tok_s_round_medians": [m["decode_tok_s"] for m in mine],
                        "ttft_ms_median": round(statistics.median(m["ttft_ms"] for m in mine), 2),
                        "rank0_peak_rss_mb": max(m["rank0_peak_rss_mb"] for m in mine),
                        "stage_peak_rss_mb": [max(s) for s in zip(*(m["stage_peak_rss_mb"] for m in mine))],
                        "calls_in_flight_max": max(m["calls_in_flight_max"] for m in mine),
                        "stage_seconds_last_round": mine[-1]["stage_seconds"]})
    return {"machine": machine(), "load_average": [round(x, 2) for x in load_average()], "options": options,
            "tokens_agree": all(t == tokens[0] for t in tokens), "engines": summary, "rounds": measured}


@click.command()
@click.option("--engine", "engines", required=True, multiple=True, type=click.Path(exists=True, file_okay=False))
@click.option("--threads", multiple=True, type=click.IntRange(1), required=True,
              help="ONNX Runtime threads per process (per stage), once per --engine in order.")
@click.option("--micro-batches", "micro", multiple=True, type=click.IntRange(0),
              help="A pipeline engine's micro-batches in flight, once per --engine in order (0: one per stage).")
@click.option("--overlap", multiple=True, type=click.Choice(["default", "on", "off"]),
              help="The executors' overlap (ExecutorConfig.overlap), once per --engine in order (default: the "
                   "runtime's: on for a pipeline engine, off for one process on CPU).")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True)
@click.option("--batch", type=click.IntRange(1), default=16, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(1), default=16, show_default=True)
@click.option("--new-tokens", type=click.IntRange(2), default=32, show_default=True)
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True)
def main(engines: tuple[str, ...], threads: tuple[int, ...], micro: tuple[int, ...], overlap: tuple[str, ...],
         rounds: int, **options) -> None:
    """Decode tok/s at --batch, TTFT at batch 1 and peak RSS per process, as JSON on stdout."""
    if len(threads) != len(engines):
        raise click.BadParameter(f"{len(threads)} values for {len(engines)} engines: give --threads once per --engine",
                                 param_hint="--threads")
    start = time.perf_counter()
    if micro and len(micro) != len(engines):
        raise click.BadParameter(f"{len(micro)} values for {len(engines)} engines", param_hint="--micro-batches")
    if overlap and len(overlap) != len(engines):
        raise click.BadParameter(f"{len(overlap)} values for {len(engines)} engines", param_hint="--overlap")
    overlaps = [{"default": None, "on": True, "off": False}[o] for o in overlap] or [None] * len(engines)
    report = side_by_side(list(engines), list(threads), [m or None for m in micro] or [None] * len(engines), overlaps,
                          rounds, **options)
    report["seconds"] = round(time.perf_counter() - start, 1)
    click.echo(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
