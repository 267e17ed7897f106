"""Decode tokens/s of tensor-parallel and plain engines, side by side, with where a TP step's time goes.

    # one engine, measured in this process
    python -m tools.bench.tp_decode --engine engines/llama7b-int8-tp2 --threads 1
    # several engines side by side: rounds in alternating order (A B, then B A, ...), each engine of each
    # round in a fresh process that loads it once, warms up and times --runs generations
    python -m tools.bench.tp_decode --engine engines/llama7b-int8-tp1 --threads 2 \\
        --engine engines/llama7b-int8-tp2 --threads 1 --rounds 2 --runs 3

`--threads` is ONNX Runtime's threads per rank: one value for every engine, or one per `--engine` in order.
Decode tok/s is greedy at batch 1, prefill excluded. For a TP engine every rank records its steps
(runtime.parallel.runner, ENGINE_TP_TRACE) and each rank's decode step is split, in ms and as a share of
the token time (the interval between two decode steps' starts), means over the timed decode steps:
  compute  the rank's segments;
  wait     inside all-reduces, before the last rank arrived (imbalance: the others were still computing);
  gloo     inside all-reduces, after the last rank arrived (the collective itself);
  outside  between steps: rank 0 broadcasts the step, samples and schedules; the others wait for it.
Ranks' timestamps are compared across processes (perf_counter is CLOCK_MONOTONIC, one clock per host)."""
from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import click

from tools.bench.env import load_average, machine
from tools.bench.isolated import run as run_isolated
from tools.bench.stats import spread

PARTS = ("compute", "wait", "gloo", "outside")


def measure(engine_dir: str, threads: int | None, prompt_tokens: int, new_tokens: int, runs: int) -> dict:
    """Load `engine_dir` once, warm up, time `runs` greedy generations at batch 1; a TP engine's step split."""
    from runtime.engine import LLM
    from runtime.parallel.runner import TRACE_ENV

    with tempfile.TemporaryDirectory() as trace_dir:
        os.environ[TRACE_ENV] = trace_dir  # the rank workers inherit it
        try:
            began = time.perf_counter()
            llm = LLM(engine_dir, max_batch_size=1, threads=threads)
            load_s = time.perf_counter() - began
        finally:
            del os.environ[TRACE_ENV]
        engine = getattr(llm.runner, "engine", None)  # rank 0 of a TP engine
        try:
            timed = time_runs(llm, engine, list(range(5, 5 + prompt_tokens)), new_tokens, runs)
        finally:
            llm.close()
        traces = [engine.trace] + [json.loads((Path(trace_dir) / f"rank{r}.json").read_text())
                                   for r in range(1, llm.runner.size)] if engine else []
    # the other ranks are this process's children, ended by close(): the largest one's peak (MiB)
    workers_mb = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024) if engine else None
    return {"engine": engine_dir, "tensor_parallel": llm.runner.size if engine else 1, "threads_per_rank": threads,
            "load_s": round(load_s, 2), "decode_tok_s": round(statistics.median(timed["rates"]), 3),
            "runs": [round(r, 3) for r in timed["rates"]],
            "all_reduce_share": round(statistics.median(timed["shares"]), 4),
            "ranks": step_split(traces, timed["steps"]) if engine else [], "tokens": timed["tokens"],
            "peak_rss_mb_other_ranks": workers_mb}


def time_runs(llm, engine, prompt: list[int], new_tokens: int, runs: int) -> dict:
    """A warm-up, then `runs` greedy generations: decode tok/s (prefill excluded), rank 0's share of the
    time inside all-reduces, each run's step indices in the TP trace, the first run's tokens."""
    from runtime.request.params import SamplingParams
    from tools.bench.measure import decode_tok_s, timed_generate

    out: dict = {"rates": [], "shares": [], "steps": [], "tokens": None}
    llm.generate([prompt], SamplingParams(max_new_tokens=2, ignore_eos=True))  # bind the call shapes
    for _ in range(runs):
        first = len(engine.trace) if engine else 0
        before = engine.reduce_seconds if engine else 0.0
        timing = timed_generate(llm, [prompt], new_tokens)
        out["rates"].append(decode_tok_s(1, new_tokens, timing))
        out["shares"].append((engine.reduce_seconds - before) / timing.total_s if engine else 0.0)
        out["steps"].append(range(first, len(engine.trace)) if engine else range(0))
        out["tokens"] = out["tokens"] or timing.token_ids[0]
    return out


def step_split(traces: list[list[list[float]]], runs: list[range]) -> list[dict]:
    """Per rank: mean ms per decode step of each part (PARTS; all_reduce = wait + gloo, step = compute +
    all_reduce, interval = step + outside: means, so that the parts add up) and its share of the interval.
    traces[rank][step] = [tokens, start, (enter, exit) per collective..., end], steps in the same order on
    every rank; `runs`: the step indices of each timed generation, the first its prefill. A decode step (one
    token) counts when the next step of its generation is a decode step too (its interval ends there)."""
    parts: list[dict[str, list[float]]] = [{k: [] for k in ("step", "interval", "all_reduce") + PARTS}
                                           for _ in traces]
    for steps in runs:
        decode = [i for i in steps[1:] if traces[0][i][0] == 1]  # [0]: the prefill (one token if cached)
        for i in decode:
            if i + 1 not in decode:
                continue
            last = [max(t[i][k] for t in traces) for k in range(2, len(traces[0][i]) - 1, 2)]  # last arrivals
            for rank, trace in enumerate(traces):
                row = trace[i]
                enters, exits = row[2:-1:2], row[3:-1:2]
                wait = sum(a - e for a, e in zip(last, enters))
                reduce = sum(x - e for e, x in zip(enters, exits))
                step, interval = row[-1] - row[1], trace[i + 1][1] - row[1]
                split = {"step": step, "interval": interval, "all_reduce": reduce, "wait": wait,
                         "gloo": reduce - wait, "compute": step - reduce, "outside": interval - step}
                for key, value in split.items():
                    parts[rank][key].append(value)
    return [{"rank": rank, "decode_steps": len(values["step"]),
             "ms": {key: round(1e3 * statistics.fmean(v), 3) if v else None for key, v in values.items()},
             "share": {key: round(statistics.fmean(values[key]) / statistics.fmean(values["interval"]), 4)
                       if values["interval"] else None for key in ("all_reduce",) + PARTS}}
            for rank, values in enumerate(parts)]


def side_by_side(engines: list[str], threads: list[int | None], rounds: int, **options) -> dict:
    """Every engine once per round, each in a fresh process, the order reversed every other round."""
    from tools.bench import tp_decode# `measure` by its module's name, also when this file runs as __main__

    pairs = list(enumerate(zip(engines, threads)))  # the same engine may come twice, with other threads
    measured = []
    for number in range(rounds):
        for slot, (engine, n) in pairs if number % 2 == 0 else pairs[::-1]:
            click.echo(f"round {number + 1}/{rounds}: {engine} (threads {n})", err=True)
            result, process = run_isolated(tp_decode.measure, engine, n, options["prompt_tokens"],
                                           options["new_tokens"], options["runs"])
            measured.append({"round": number + 1, "slot": slot,
                             "peak_rss_mb_rank0": round(process["peak_rss_mb"])} | result)
    summary = [summarize([m for m in measured if m["slot"] == slot]) for slot, _ in pairs]
    tokens = [m["tokens"] for m in measured]
    return {"machine": machine(), "load_average": [round(x, 2) for x in load_average()], "options": options,
            "order": [m["engine"] for m in measured], "tokens_agree": all(t == tokens[0] for t in tokens),
            "engines": summary, "rounds": measured}


def summarize(rounds: list[dict]) -> dict:
    """One engine over its rounds: decode tok/s median/min/max of every run; per-rank figures' means."""
    first = rounds[0]
    ranks = [{"rank": r["rank"], **{group: {key: _mean([x["ranks"][r["rank"]][group][key] for x in rounds])
                                             for key in r[group]} for group in ("ms", "share")}}
             for r in first["ranks"]]  # means over the rounds, so that the parts still add up
    return {"engine": first["engine"], "tensor_parallel": first["tensor_parallel"],
            "threads_per_rank": first["threads_per_rank"],
            "decode_tok_s": {k: round(v, 3) for k, v in spread([r for x in rounds for r in x["runs"]]).items()},
            "round_medians": [x["decode_tok_s"] for x in rounds], "ranks": ranks,
            "peak_rss_mb_rank0": max(x["peak_rss_mb_rank0"] for x in rounds),
            "peak_rss_mb_other_ranks": _mean([x["peak_rss_mb_other_ranks"] for x in rounds])}


def _mean(values: list) -> float | None:
    numbers = [v for v in values if v is not None]
    return round(statistics.fmean(numbers), 4) if numbers else None


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode, batch 1 ({report['machine']}; load {report['load_average']})")
    for column in ("engine", "ranks x threads", "tok/s median [min, max]", "rank", "peak RSS MiB", "token ms",
                   *(f"{p} %" for p in ("all_reduce",) + PARTS)):
        table.add_column(column)
    for e in report["engines"]:
        rate = e["decode_tok_s"]
        head = [Path(e["engine"]).name, f"{e['tensor_parallel']} x {e['threads_per_rank']}",
                f"{rate['median']:.3f} [{rate['min']:.3f}, {rate['max']:.3f}]"]
        for r in e["ranks"] or [{"rank": 0, "ms": {"interval": None}, "share": {}}]:
            rss = e["peak_rss_mb_rank0"] if r["rank"] == 0 else e["peak_rss_mb_other_ranks"]
            table.add_row(*head, str(r["rank"]), _fmt(rss, 1), _fmt(r["ms"]["interval"], 1),
                          *(_fmt(r["share"].get(p), 100) for p in ("all_reduce",) + PARTS))
            head = ["", "", ""]
    Console(stderr=True, width=200).print(table)


def _fmt(value: float | None, scale: float) -> str:
    return "-" if value is None else f"{value * scale:.1f}"


@click.command()
@click.option("--engine", "engines", required=True, multiple=True, type=click.Path(exists=True, file_okay=False),
              help="An engine directory; repeat to measure several side by side.")
@click.option("--threads", multiple=True, type=click.IntRange(1),
              help="ONNX Runtime threads per rank: once for every engine, or once per --engine in order.")
@click.option("--rounds", type=click.IntRange(1), default=None,
              help="Rounds of every engine in a fresh process, order alternating. Default: 2 for several "
                   "engines; for one engine, measured in this process.")
@click.option("--prompt-tokens", type=click.IntRange(1), default=16, show_default=True)
@click.option("--new-tokens", type=click.IntRange(2), default=16, show_default=True)
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True,
              help="Timed generations per engine per round.")
def main(engines: tuple[str, ...], threads: tuple[int, ...], rounds: int | None, prompt_tokens: int,
         new_tokens: int, runs: int) -> None:
    """Decode tokens/s (median, min, max of the runs) and each rank's step split, as JSON on stdout."""
    if len(threads) not in (0, 1, len(engines)):
        raise click.BadParameter(f"{len(threads)} values for {len(engines)} engines: give --threads once for "
                                 f"all, or once per --engine", param_hint="--threads")
    per_engine = list(threads) * len(engines) if len(threads) == 1 else list(threads) or [None] * len(engines)
    options = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "runs": runs}
    if len(engines) == 1 and rounds is None:
        click.echo(json.dumps(measure(engines[0], per_engine[0], **options)))
        return
    report = side_by_side(list(engines), per_engine, rounds or 2, **options)
    print_table(report)
    if not report["tokens_agree"]:
        click.echo("note: the engines' greedy tokens differ (see rounds[].tokens)", err=True)
    click.echo(json.dumps(report))


if __name__ == "__main__":
    main()
