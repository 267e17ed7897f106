"""Is a chat question safe to show as a demo on an engine whose int8 activations move logits? For each prompt:
transformers' float greedy answer on the same GGUF file and its smallest top-1 / top-2 logit margin along the
answer, the engine's greedy answer; and the engine's logit noise on those margins, measured on prose windows
(at each position, how far the engine moves the float top-1 minus top-2 gap: median, p99, max).

    python -m tools.bench.question_margin --gguf checkpoints/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --engine engines/smollm2 --prompt "What is the capital of France?" [--prompt ...] [--windows 8]

A question is safe when its smallest float margin is well above the noise's max (docs/ACCURACY.md, "The README's
question")."""
from __future__ import annotations

from pathlib import Path

import click
import numpy as np


def float_answer(model, tokenizer, prompt: str, max_new: int) -> tuple[list[int], list[float]]:
    """Greedy answer ids (up to and with EOS) and the top-1 minus top-2 logit margin at each step."""
    import torch

    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False))
    out, margins = [], []
    with torch.no_grad():
        for _ in range(max_new):
            top = torch.topk(model(torch.tensor([ids])).logits[0, -1], 2)
            margins.append(float(top.values[0] - top.values[1]))
            out.append(int(top.indices[0]))
            ids.append(out[-1])
            if out[-1] == tokenizer.eos_token_id:
                break
    return out, margins


def margin_noise(engine: Path, gguf: Path, windows: int) -> np.ndarray:
    """|engine gap - float gap| of the float top-2 tokens at every position of `windows` prose windows of 256."""
    from builder.reference_check import engine_logits
    from tools.bench.gguf_perplexity import transformers_model
    from tools.bench.gguf_perplexity import windows as prose_windows

    ids = prose_windows(engine / "tokenizer.json", windows * 256, 256)
    theirs = transformers_model(gguf)
    moves = []
    for row, ours in zip(ids, engine_logits(engine, [w.tolist() for w in ids])):
        ref = theirs(row)
        top2 = np.argsort(ref, -1)[:, -2:]
        gap = lambda logits: np.take_along_axis(logits, top2[:, 1:], -1) - np.take_along_axis(logits, top2[:, :1], -1)
        moves.append(np.abs(gap(ours) - gap(ref))[:, 0])
    return np.concatenate(moves)


@click.command()
@click.option("--gguf", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--prompt", "prompts", multiple=True, required=True)
@click.option("--windows", default=8, show_default=True)
@click.option("--max-new-tokens", default=24, show_default=True)
def main(gguf: Path, engine: Path, prompts: tuple[str, ...], windows: int, max_new_tokens: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    llm = LLM(engine)
    try:
        for prompt in prompts:
            answer, margins = float_answer(model, tokenizer, prompt, max_new_tokens)
            ours = llm.generate([llm.chat_prompt_ids([{"role": "user", "content": prompt}])],
                                SamplingParams(max_new_tokens=max_new_tokens))[0]
            same = ours.token_ids == answer[:len(ours.token_ids)] and len(ours.token_ids) == len(answer)
            click.echo(f"{prompt!r}: float {tokenizer.decode(answer, skip_special_tokens=True)!r}, smallest margin "
                       f"{min(margins):.3f} (step {int(np.argmin(margins))}), first {margins[0]:.3f}; engine "
                       f"{ours.text!r} ({'identical' if same else 'DIFFERENT'})")
    finally:
        llm.close()
    noise = margin_noise(engine, gguf, windows)
    click.echo(f"engine's move of the float top-2 gap over {noise.size} prose positions: median {np.median(noise):.3f}, "
               f"p99 {np.percentile(noise, 99):.3f}, max {noise.max():.3f}")


if __name__ == "__main__":
    main()
