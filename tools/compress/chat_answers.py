"""On-policy text for a draft from the target *engine* (the model speculation will verify, and far faster than
transformers' generate on a CPU): its greedy answers to chat prompts, each conversation written out in the chat
template's markup, one after the other, as a text file engine-compress takes with --text.

    python -m tools.compress.chat_answers --engine TARGET_ENGINE --prompts tools/compress/chat_prompts_train.txt \
        --max-new 128 --out answers.txt [--chunk 256 --max-minutes 30]

Prompts are answered `--chunk` at a time (one `LLM.generate` call each), each chunk appended to --out and counted
in OUT.progress.json (engine, prompts done, answer tokens, seconds): a second run with the same arguments resumes
after the last whole chunk, and --max-minutes stops after the chunk that crosses it.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from builder.compress.draft import read_prompts
from runtime.engine import LLM
from runtime.request.params import SamplingParams


def _progress(out: Path) -> Path:
    return out.with_name(out.name + ".progress.json")


def read_progress(out: Path, engine: str) -> dict:
    """What a previous run of the same --engine wrote into `out` (nothing when --out is new)."""
    path = _progress(out)
    if not path.is_file() or not out.is_file():
        return {"engine": engine, "done": 0, "tokens": 0, "seconds": 0.0}
    progress = json.loads(path.read_text())
    if progress["engine"] != engine:
        raise click.UsageError(f"{out} holds answers of {progress['engine']}, not {engine}: give another --out")
    return progress


@click.command()
@click.option("--engine", required=True, help="The target engine.")
@click.option("--prompts", "prompt_file", required=True, help="Chat prompts, one user message a line.")
@click.option("--max-new", default=128, show_default=True)
@click.option("--chunk", default=256, show_default=True, help="Prompts per generate call (and per resume point).")
@click.option("--max-minutes", type=float, help="Stop after the chunk that crosses this many minutes.")
@click.option("--out", required=True, type=click.Path(path_type=Path))
def main(engine, prompt_file, max_new, chunk, max_minutes, out) -> None:
    """Append the target engine's greedy conversations for the prompts not yet answered to --out."""
    prompts = read_prompts(prompt_file)
    progress = read_progress(out, str(engine))
    if progress["done"] == 0:
        out.write_text("", encoding="utf-8")
    start = time.perf_counter()
    llm = LLM(engine)
    try:
        while progress["done"] < len(prompts) and (max_minutes is None or time.perf_counter() - start < 60 * max_minutes):
            ids = [llm.chat_prompt_ids([{"role": "user", "content": p}])
                   for p in prompts[progress["done"]: progress["done"] + chunk]]
            begun = time.perf_counter()
            done = llm.generate(ids, SamplingParams(max_new_tokens=max_new, temperature=0.0))
            texts = [llm.tokenizer.decode(p + d.token_ids, skip_special_tokens=False) for p, d in zip(ids, done)]
            with out.open("a", encoding="utf-8") as f:
                f.write("\n".join(texts) + "\n")
            progress["done"] += len(ids)
            progress["tokens"] += sum(len(d.token_ids) for d in done)
            progress["seconds"] = round(progress["seconds"] + time.perf_counter() - begun, 1)
            _progress(out).write_text(json.dumps(progress) + "\n")
            click.echo(f"{progress['done']}/{len(prompts)} prompts, {progress['tokens']} answer tokens, "
                       f"{progress['seconds']} s", err=True)
    finally:
        llm.close()
    click.echo(f"{progress['done']} conversations, {progress['tokens']} answer tokens -> {out}")


if __name__ == "__main__":
    main()
