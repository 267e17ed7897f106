"""Batch-1 greedy speedup of a target engine with a draft engine, on held-out chat prompts: each prompt is decoded
alone and with the draft (fixed draft length, then the runtime's adaptive default), alternated prompt by prompt so
load changes hit both; tokens must be identical. Also the draft's own decode cost beside the target's (the bound:
c = draft step / target step), and any other engines' (--cost-engine: e.g. a stand-in with a smaller head).

    python -m tools.compress.draft_speedup --engine TARGET_ENGINE --draft DRAFT_ENGINE \
        --prompts tools/compress/chat_prompts_eval.txt --max-new 96 --out /tmp/speedup.json
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click

from builder.compress.draft import read_prompts
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.speculation.speculator import Speculation


def _timed(llm: LLM, ids: list[int], params: SamplingParams, spec: Speculation | None):
    start = time.perf_counter()
    done = llm.generate([ids], params, speculation=spec)[0]
    return done, time.perf_counter() - start


def decode_costs(engines: dict[str, str], prompt: list[int], new_tokens: int, rounds: int = 5) -> dict[str, float]:
    """Median milliseconds per decoded token of each engine alone at batch 1 (the prefill timed apart and taken
    off), rounds alternated across the engines so load changes hit all of them."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    llms = {name: LLM(path) for name, path in engines.items()}
    try:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(rounds + 1):  # the first round warms up
            for name, llm in llms.items():
                _, prefill = _timed(llm, prompt, first, None)
                _, whole = _timed(llm, prompt, params, None)
                times[name].append(1000 * (whole - prefill) / (new_tokens - 1))
        return {name: round(statistics.median(t[1:]), 3) for name, t in times.items()}
    finally:
        for llm in llms.values():
            llm.close()


def alternated(llm: LLM, prompts: list[list[int]], params: SamplingParams, modes: dict) -> dict[str, dict]:
    """Every prompt decoded in every mode, the modes in turn first; totals, per-prompt rates, acceptance and
    whether each mode's tokens equal the target's alone."""
    rows = {m: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "verifies": 0, "same": True,
                "per_prompt": []} for m in modes}
    for n, ids in enumerate(prompts):
        order = list(modes)[n % len(modes):] + list(modes)[: n % len(modes)]
        tokens = {}
        for mode in order:
            done, took = _timed(llm, ids, params, modes[mode])
            tokens[mode], row, stats = done.token_ids, rows[mode], done.metrics.get("speculation") or {}
            row["tokens"] += len(done.token_ids)
            row["seconds"] += took
            row["per_prompt"].append(len(done.token_ids) / took)
            row["drafted"] += stats.get("drafted", 0)
            row["accepted"] += stats.get("accepted", 0)
            row["verifies"] += stats.get("verify_calls", 0)
        for mode in modes:
            rows[mode]["same"] &= tokens[mode] == tokens["alone"]
    return rows


def summary(rows: dict[str, dict]) -> dict[str, dict]:
    base = rows["alone"]
    return {mode: {"tok_s": round(row["tokens"] / row["seconds"], 2),
                   "speedup": round(row["tokens"] / row["seconds"] * base["seconds"] / base["tokens"], 3),
                   "median_prompt_speedup": round(statistics.median(
                       a / b for a, b in zip(row["per_prompt"], base["per_prompt"])), 3),
                   "acceptance": round(row["accepted"] / row["drafted"], 3) if row["drafted"] else None,
                   # tokens a verify yields: the accepted drafts and the target's own token
                   "accepted_length": round(1 + row["accepted"] / row["verifies"], 3) if row["verifies"] else None,
                   "drafted": row["drafted"], "same_tokens": row["same"]} for mode, row in rows.items()}


@click.command()
@click.option("--engine", required=True, help="The target engine.")
@click.option("--draft", required=True, help="The draft engine (or the target's own draft/ folder).")
@click.option("--prompts", "prompt_file", required=True, help="Chat prompts, one user message a line.")
@click.option("--max-new", default=96, show_default=True)
@click.option("--num-draft", default=3, show_default=True, help="Fixed draft length of the 'fixed' mode.")
@click.option("--limit", type=int, help="Only the first N prompts.")
@click.option("--cost-engine", multiple=True, help="NAME=DIR: another engine whose decode cost is timed beside.")
@click.option("--cost-rounds", default=5, show_default=True, help="Rounds of the decode cost timing (0: none).")
@click.option("--out", type=click.Path(path_type=Path))
def main(engine, draft, prompt_file, max_new, num_draft, limit, cost_engine, cost_rounds, out) -> None:
    """Alone vs fixed-length drafting vs adaptive drafting, batch 1, greedy, alternated per prompt."""
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    modes = {"alone": None, f"draft k={num_draft}": Speculation("draft", num_draft=num_draft, adaptive=False,
                                                                   fallback=False),
             "draft adaptive": Speculation("draft")}
    llm = LLM(engine, draft=draft, process_thread_pool=True)  # one thread pool for target and draft (README)
    try:
        prompts = [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in read_prompts(prompt_file)[:limit]]
        _timed(llm, prompts[0], params, modes[f"draft k={num_draft}"])  # warm both sessions
        rows = alternated(llm, prompts, params, modes)
    finally:
        llm.close()
    report = {"prompts": len(prompts), "max_new": max_new, "modes": summary(rows)}
    if cost_rounds:
        engines = {"target": engine, "draft": draft} | dict(item.split("=", 1) for item in cost_engine)
        costs = decode_costs(engines, [min(i, 8191) for i in prompts[0]], max_new, cost_rounds)  # ids every head has
        report["decode_ms_per_token"] = costs
        report["cost_over_target"] = {name: round(ms / costs["target"], 3) for name, ms in costs.items()}
    text = json.dumps(report, indent=1)
    click.echo(text)
    if out:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
