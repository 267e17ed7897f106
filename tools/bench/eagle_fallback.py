"""EAGLE's pay-or-fall-back at batch 8 (issue 49): issue 49's held-out chat questions in groups of 8 submitted
together, plain decoding against the runtime's adaptive EAGLE (`Speculation("eagle")`), alternated by group
(tools/compress/eagle_speedup.py `batched`), in a fresh process: the policy starts with nothing measured, as a
server does. `--batch 1`: one question at a time, plain against adaptive, alternated per question. Also prints what
the policy measured (acceptance, plain and verify costs) and how many verify calls ran.

    python -m tools.bench.eagle_fallback --engine ENGINE [--batch 8] [--max-new 128]
"""
from __future__ import annotations

import json
import time

import click

from builder.compress.draft import read_prompts
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.speculation.speculator import Speculation
from tools.compress.draft_speedup import alternated, summary
from tools.compress.eagle_speedup import batched

PROMPTS = "tools/compress/eagle_prompts_eval.txt"


def measured(llm: LLM) -> dict:
    """What the pay-or-fall-back policy measured (runtime/speculation/draft_policy.py StepCosts), in ms."""
    costs = llm.executor.speculator.costs
    ms = lambda table: {n: round(s * 1e3, 3) for n, s in table.items()}
    return {"acceptance": costs.acceptance, "plain_row_ms": ms(costs.plain_rows), "verify_ms": ms(costs.verifies)}


@click.command()
@click.option("--engine", required=True, help="The target engine, built with its EAGLE head (draft/).")
@click.option("--prompts", "prompt_file", default=PROMPTS, show_default=True)
@click.option("--batch", default=8, show_default=True, help="8: groups of 8 together; 1: one at a time.")
@click.option("--max-new", default=128, show_default=True)
def main(engine, prompt_file, batch, max_new) -> None:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    llm = LLM(engine, process_thread_pool=True)  # one thread pool for the target and its head
    verifies = 0
    verify = llm.executor.speculator.verify

    def counted(*args, **kwargs):
        nonlocal verifies
        verifies += 1
        return verify(*args, **kwargs)

    llm.executor.speculator.verify = counted
    try:
        prompts = [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in read_prompts(prompt_file)]
        llm.generate([prompts[0]], params)  # the target's shapes warm; the policy has measured no verify
        start = time.perf_counter()
        if batch == 1:
            report = summary(alternated(llm, prompts, params, {"alone": None, "eagle adaptive": Speculation("eagle")}))
        else:
            report = batched(llm, prompts, params, Speculation("eagle"), batch)
        report |= {"policy": measured(llm), "verify_calls": verifies, "seconds": round(time.perf_counter() - start, 1)}
    finally:
        llm.close()
    click.echo(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
