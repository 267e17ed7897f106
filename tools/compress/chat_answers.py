"""On-policy text for a draft from the target *engine* (the model speculation will verify, and far faster than
transformers' generate on a CPU): its greedy answers to chat prompts, each conversation written out in the chat
template's markup, one after the other, as a text file engine-compress takes with --text.

    python -m tools.compress.chat_answers --engine TARGET_ENGINE --prompts tools/compress/chat_prompts_train.txt \
        --max-new 128 --out answers.txt
"""
from __future__ import annotations

from pathlib import Path

import click

from builder.compress.draft import read_prompts
from runtime.engine import LLM
from runtime.request.params import SamplingParams


@click.command()
@click.option("--engine", required=True, help="The target engine.")
@click.option("--prompts", "prompt_file", required=True, help="Chat prompts, one user message a line.")
@click.option("--max-new", default=128, show_default=True)
@click.option("--out", required=True, type=click.Path(path_type=Path))
def main(engine, prompt_file, max_new, out) -> None:
    """Write the target engine's greedy conversations for every prompt into --out."""
    llm = LLM(engine)
    try:
        prompts = [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in read_prompts(prompt_file)]
        done = llm.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=0.0))
        texts = [llm.tokenizer.decode(ids + d.token_ids, skip_special_tokens=False) for ids, d in zip(prompts, done)]
    finally:
        llm.close()
    out.write_text("\n".join(texts) + "\n", encoding="utf-8")
    click.echo(f"{len(texts)} conversations, {sum(len(d.token_ids) for d in done)} answer tokens -> {out}")


if __name__ == "__main__":
    main()
