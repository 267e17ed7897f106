"""Issue 49's figures for an engine with an EAGLE head, on held-out chat questions: batch-1 greedy speed alone, with
a fixed chain of k drafts and with the runtime's adaptive default (pay-or-fall-back), alternated prompt by prompt
(tools/compress/draft_speedup.py), tokens compared with decoding alone; the mean accepted length (tokens a verify
yields); the head's cost per draft token beside a target decode step; and batch 8 (all prompts in groups of 8
submitted together, alone against the adaptive default, alternated by group).

    python -m tools.compress.eagle_speedup --engine ENGINE --prompts tools/compress/eagle_prompts_eval.txt \
        --max-new 128 --out eagle.json
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import numpy as np

from builder.compress.draft import read_prompts
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.speculation.speculator import Speculation
from tools.compress.draft_speedup import alternated, summary


def call_costs(llm: LLM, prompt: list[int], calls: int = 64, verify: tuple[int, ...] = (2, 4)) -> dict[str, float]:
    """Median milliseconds of one target decode step, one head draft step (a one-token call each) and a verify of
    each length in `verify` (the call the runtime makes: every position's logits and features), on row 0 after the
    prompt, alternated call by call; each beside the target step."""
    position = len(prompt)
    llm.runner.extend(0, 0, prompt)
    _, hidden = llm.runner.extend(0, 0, prompt, all_logits=True, head="hidden")
    llm.draft_runner.run(0, 0, prompt[1:], hidden[:-1])
    times: dict[str, list[float]] = {"target_step_ms": [], "head_step_ms": []} | {f"verify_{n}_ms": [] for n in verify}
    for _ in range(calls):
        start = time.perf_counter()
        llm.runner.decode(0, np.array([prompt[-1]]), np.array([position]))
        times["target_step_ms"].append(time.perf_counter() - start)
        start = time.perf_counter()
        llm.draft_runner.run(0, position - 1, [prompt[-1]], hidden[-1:])
        times["head_step_ms"].append(time.perf_counter() - start)
        for n in verify:
            start = time.perf_counter()
            llm.runner.extend(0, position, prompt[-n:], all_logits=True, features=True)
            times[f"verify_{n}_ms"].append(time.perf_counter() - start)
    ms = {name: 1000 * statistics.median(values) for name, values in times.items()}
    over = {name.replace("_ms", "_over_target"): value / ms["target_step_ms"] for name, value in ms.items()
            if name != "target_step_ms"}
    return {k: round(v, 3) for k, v in (ms | over).items()}


def batched(llm: LLM, prompts: list[list[int]], params: SamplingParams, spec: Speculation, size: int = 8) -> dict:
    """Groups of `size` prompts submitted together, alone and with `spec` in turn; tokens/s of each and the ratio."""
    totals = {"alone": [0, 0.0], "eagle": [0, 0.0]}
    same = True
    for n, first in enumerate(range(0, len(prompts), size)):
        group = prompts[first:first + size]
        done = {}
        for mode in (["alone", "eagle"] if n % 2 == 0 else ["eagle", "alone"]):
            start = time.perf_counter()
            done[mode] = llm.generate(group, params, speculation=spec if mode == "eagle" else None)
            totals[mode][0] += sum(len(c.token_ids) for c in done[mode])
            totals[mode][1] += time.perf_counter() - start
        same &= [c.token_ids for c in done["alone"]] == [c.token_ids for c in done["eagle"]]
    rates = {mode: tokens / seconds for mode, (tokens, seconds) in totals.items()}
    return {"batch": size, "alone_tok_s": round(rates["alone"], 2), "eagle_tok_s": round(rates["eagle"], 2),
            "speedup": round(rates["eagle"] / rates["alone"], 3), "same_tokens": same}


@click.command()
@click.option("--engine", required=True, help="The target engine, built with its EAGLE head (draft/).")
@click.option("--prompts", "prompt_file", required=True, help="Chat prompts, one user message a line.")
@click.option("--max-new", default=128, show_default=True)
@click.option("--num-draft", default=4, show_default=True, help="Chain length of the fixed mode.")
@click.option("--limit", type=int, help="Only the first N prompts.")
@click.option("--batch", default=8, show_default=True, help="Batch of the batched comparison (0: none).")
@click.option("--out", type=click.Path(path_type=Path))
def main(engine, prompt_file, max_new, num_draft, limit, batch, out) -> None:
    """Alone vs a fixed EAGLE chain vs the adaptive default at batch 1, the head's cost, and batch `--batch`."""
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    modes = {"alone": None, f"eagle k={num_draft}": Speculation("eagle", num_draft=num_draft, adaptive=False,
                                                                   fallback=False),
             "eagle adaptive": Speculation("eagle")}
    llm = LLM(engine, process_thread_pool=True)  # one thread pool for the target and its head
    try:
        prompts = [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in read_prompts(prompt_file)[:limit]]
        llm.generate([prompts[0]], params, speculation=modes[f"eagle k={num_draft}"])  # warm both sessions
        report = {"engine": str(engine), "prompts": len(prompts), "max_new": max_new,
                  "batch_1": summary(alternated(llm, prompts, params, modes)), "costs": call_costs(llm, prompts[0])}
        if batch:
            report[f"batch_{batch}"] = batched(llm, prompts, params, Speculation("eagle"), batch)
    finally:
        llm.close()
    text = json.dumps(report, indent=1)
    click.echo(text)
    if out:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
