"""Batch-1 greedy speedup of a target engine with a draft engine, on held-out chat prompts: each prompt is decoded
alone and with the draft (fixed draft length, then the runtime's adaptive default), alternated prompt by prompt so
load changes hit both; tokens must be identical. Also the draft's own decode cost beside the target's (the bound:
c = draft step / target step).

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


def _decode_rate(path: str, prompts: list[list[int]], params: SamplingParams) -> float:
    """Tokens/s of an engine decoding alone (used for the draft's step cost)."""
    llm = LLM(path)
    try:
        tokens = seconds = 0.0
        for ids in prompts:
            done, took = _timed(llm, ids, params, None)
            tokens, seconds = tokens + len(done.token_ids), seconds + took
        return tokens / seconds
    finally:
        llm.close()


@click.command()
@click.option("--engine", required=True, help="The target engine.")
@click.option("--draft", required=True, help="The draft engine (or the target's own draft/ folder).")
@click.option("--prompts", "prompt_file", required=True, help="Chat prompts, one user message a line.")
@click.option("--max-new", default=96, show_default=True)
@click.option("--num-draft", default=3, show_default=True, help="Fixed draft length of the 'fixed' mode.")
@click.option("--limit", type=int, help="Only the first N prompts.")
@click.option("--out", type=click.Path(path_type=Path))
def main(engine, draft, prompt_file, max_new, num_draft, limit, out) -> None:
    """Alone vs fixed-length drafting vs adaptive drafting, batch 1, greedy, alternated per prompt."""
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    modes = {"alone": None, f"draft k={num_draft}": Speculation("draft", num_draft=num_draft, adaptive=False,
                                                                   fallback=False),
             "draft adaptive": Speculation("draft")}
    llm = LLM(engine, draft=draft)
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in read_prompts(prompt_file)[:limit]]
    _timed(llm, prompts[0], params, modes[f"draft k={num_draft}"])  # warm both sessions
    rows = {m: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "same": True, "per_prompt": []}
            for m in modes}
    for ids in prompts:
        reference = None
        for mode, spec in modes.items():
            done, took = _timed(llm, ids, params, spec)
            reference = done.token_ids if reference is None else reference
            row = rows[mode]
            row["tokens"] += len(done.token_ids)
            row["seconds"] += took
            row["per_prompt"].append(len(done.token_ids) / took)
            row["same"] &= done.token_ids == reference
            stats = done.metrics.get("speculation") or {}
            row["drafted"] += stats.get("drafted", 0)
            row["accepted"] += stats.get("accepted", 0)
    llm.close()
    base = rows["alone"]["tokens"] / rows["alone"]["seconds"]
    report = {"prompts": len(prompts), "max_new": max_new, "modes": {}}
    for mode, row in rows.items():
        rate = row["tokens"] / row["seconds"]
        report["modes"][mode] = {"tok_s": round(rate, 2), "speedup": round(rate / base, 3),
                                 "median_prompt_speedup": round(statistics.median(
                                     a / b for a, b in zip(row["per_prompt"], rows["alone"]["per_prompt"])), 3),
                                 "acceptance": round(row["accepted"] / row["drafted"], 3) if row["drafted"] else None,
                                 "drafted": row["drafted"], "same_tokens": row["same"]}
    few = prompts[: min(4, len(prompts))]
    draft_rate, target_rate = _decode_rate(draft, few, params), _decode_rate(engine, few, params)
    report["decode_tok_s"] = {"draft_alone": round(draft_rate, 2), "target_alone": round(target_rate, 2),
                              "c_draft_over_target": round(target_rate / draft_rate, 3)}
    text = json.dumps(report, indent=1)
    click.echo(text)
    if out:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
