"""What a reduced draft vocabulary (drafting only among the target's most frequent tokens, as FR-Spec / EAGLE-3 do)
would keep of a draft's agreement with its target: on the target's own greedy answers to held-out chat prompts
(tools/compress/chat_answers.py), the fraction of answer tokens the draft's argmax predicts, with its full head
and with its head cut to the V most frequent tokens of the training text (counted on text the draft trained on;
tokens never seen there ranked by id, BPE's merge order).

    python -m tools.compress.draft_vocab --draft DRAFT_CKPT --answers answers_eval.txt --freq-text answers_train.txt \
        --sizes 2048,4096,8192,16384
"""
from __future__ import annotations

import json

import click
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ASSISTANT = "<|im_start|>assistant\n"


def answer_positions(tokenizer, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The conversations' token ids and a mask of the positions whose next token is an answer token."""
    ids, mask = [], []
    for conversation in text.split("<|im_start|>system")[1:]:
        prompt, _, answer = ("<|im_start|>system" + conversation).partition(ASSISTANT)
        head = tokenizer(prompt + ASSISTANT, add_special_tokens=False).input_ids
        tail = tokenizer(answer.rstrip("\n"), add_special_tokens=False).input_ids
        ids += head + tail
        mask += [False] * (len(head) - 1) + [True] * len(tail) + [False]
    return torch.tensor(ids), torch.tensor(mask[: len(ids)])


@click.command()
@click.option("--draft", required=True)
@click.option("--answers", required=True, help="The target's conversations on held-out prompts.")
@click.option("--freq-text", required=True, multiple=True, help="Text the frequencies are counted on.")
@click.option("--sizes", default="2048,4096,8192,16384", show_default=True)
@click.option("--window", default=512, show_default=True)
def main(draft, answers, freq_text, sizes, window) -> None:
    """Greedy agreement of the draft on answer tokens, full head vs heads of the most frequent tokens."""
    tokenizer = AutoTokenizer.from_pretrained(draft)
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab, dtype=torch.int64)
    for path in freq_text:
        ids = tokenizer(open(path, encoding="utf-8").read(), add_special_tokens=False).input_ids
        counts += torch.bincount(torch.tensor(ids), minlength=vocab)
    ids, mask = answer_positions(tokenizer, open(answers, encoding="utf-8").read())
    logits = []
    with torch.no_grad():
        for first in range(0, ids.numel(), window):  # windows: agreement with a context cut at window starts
            logits.append(model(input_ids=ids[None, first: first + window], use_cache=False).logits[0])
    logits = torch.cat(logits)[:-1][mask[:-1]]
    truth = ids[1:][mask[:-1]]
    report = {"answer_tokens": int(truth.numel()), "full_vocab": {"agreement": round(
        (logits.argmax(-1) == truth).float().mean().item(), 4)}}
    order = counts.argsort(descending=True, stable=True)  # ties (unseen tokens) by id: BPE's earlier merges first
    for size in map(int, sizes.split(",")):
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[order[:size]] = True
        restricted = logits.masked_fill(~keep, float("-inf")).argmax(-1)
        report[f"top_{size}"] = {"coverage": round(keep[truth].float().mean().item(), 4),
                                 "agreement": round((restricted == truth).float().mean().item(), 4)}
    click.echo(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
