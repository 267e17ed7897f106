"""An engine's EAGLE head scored teacher-forced, the way the runtime drafts, on conversations (chat_answers' files):
at every reply position the runtime's own `draft_chain` drafts a chain from the target engine's features (the head
caught up on the pairs before, its chain's KV overwritten by the next position's, as after a rejection), and each
draft is checked against the target's greedy token, given the drafts before it were right. The figures are
evaluate_head's (builder/compress/eagle.py, `scored` "replies"): with --head-checkpoint and --target-checkpoint the
torch head is scored on the same tokens beside it, so the engine's figure and the training's can be compared.

    python -m tools.compress.eagle_score --engine ENGINE --text answers_eval.txt --max-new 64 \
        [--head-checkpoint HEAD_DIR --target-checkpoint TARGET_DIR]
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.speculation.draft_policy import StepCosts, timed
from runtime.speculation.eagle import Features, draft_chain
from runtime.speculation.speculator import SpecState, Speculation

CHAIN = 3


def figures(hits: np.ndarray, tried: np.ndarray) -> dict:
    """accept_n (the n-th draft right, given the ones before were) and accepted_length_3, as evaluate_head."""
    rates = [float(h / max(t, 1)) for h, t in zip(hits, tried)]
    return {f"accept_{n + 1}": rate for n, rate in enumerate(rates)} | {
        "accepted_length_3": sum(math.prod(rates[:n]) for n in range(CHAIN + 1)), "drafts_scored": int(tried[0])}


def score_engine(llm: LLM, ids: list[int], reply: int, chain: int = CHAIN, slot: int = 0) -> tuple:
    """(hits [chain], tried [chain], the chains drafted) of the engine's head on one conversation `ids` whose reply starts at `reply`:
    a chain drafted by the runtime's draft_chain at each position from the reply's first token on, as a request
    whose newest token is there, with every earlier feature held (as the calls on its row return them)."""
    logits, features = llm.runner.extend(slot, 0, ids, all_logits=True, head="hidden")
    greedy = logits.argmax(-1)  # [n]: the target's token after each position
    state = SpecState(Speculation("eagle", num_draft=chain, adaptive=False, fallback=False))
    seq = SimpleNamespace(speculation=state, slot=slot, params=SamplingParams(temperature=0.0), all_ids=[])
    hits, tried, chains = np.zeros(chain), np.zeros(chain), []
    for last in range(reply, len(ids)):  # the drafts up to the token after the last (the target's greedy[-1])
        seq.all_ids, state.features = ids[:last + 1], Features(0, len(ids), [features])
        drafts, _ = draft_chain(llm.runner, llm.draft_runner, seq, min(chain, len(ids) - last), StepCosts(), timed)
        chains.append(drafts)
        for i, token in enumerate(drafts):
            tried[i] += 1
            if token != greedy[last + i]:
                break
            hits[i] += 1
    return hits, tried, chains


def conversations(tokenizer, text: str, max_new: int | None) -> list[tuple[list[int], int]]:
    """Each conversation of `text` (chat_answers' format) as (its tokens through the first `max_new` reply tokens,
    where its reply starts)."""
    import torch

    from builder.compress.data import chat_markup, reply_mask

    markup = chat_markup(tokenizer)
    if markup is None:
        raise click.UsageError("the engine's tokenizer has no chat template: no replies to score")
    stream = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    mask = reply_mask(stream, *markup, lambda token: not tokenizer.decode([token]).strip()).tolist()
    out, begin, ids = [], 0, stream.tolist()
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (mask[i - 1] and not mask[i]):  # a reply ends
            start = next(j for j in range(i - 1, begin - 1, -1) if not mask[j]) + 1
            end = i if max_new is None else min(i, start + max_new)
            out.append((ids[begin:end], start - begin))
            begin = next((j for j in range(i, len(ids)) if ids[j] == markup[1]), len(ids))
    return [(c, r) for c, r in out if r < len(c) - 1]


def score_offline(head_dir: Path, target_dir: Path, convs: list[tuple[list[int], int]]) -> dict:
    """evaluate_head (replies scored) of the trained head on the same conversations, each one window."""
    import torch
    from safetensors.torch import load_file

    from builder.compress.checkpoint import load_model
    from builder.compress.eagle import WEIGHTS_FILE, EagleHead, evaluate_head

    model = load_model(target_dir)
    weights = load_file(str(head_dir / WEIGHTS_FILE))
    head = EagleHead(model, weights.pop("draft_ids"))
    head.load_state_dict(weights)
    full = model.get_output_embeddings().weight.detach()
    longest = 1 + max(len(ids) for ids, _ in convs)  # padded at the end (causal: no position reads the padding)
    rows = torch.tensor([ids + [ids[-1]] * (longest - len(ids)) for ids, _ in convs])
    position = torch.arange(longest)[None]
    replies = (position >= torch.tensor([r for _, r in convs])[:, None]) & (  # and the token after the last
        position <= torch.tensor([len(ids) for ids, _ in convs])[:, None])
    with torch.no_grad():
        features = model.model(input_ids=rows).last_hidden_state
    return evaluate_head(head, full, rows, features, replies=replies)


@click.command()
@click.option("--engine", required=True, help="The target engine, built with its EAGLE head (draft/).")
@click.option("--text", "text_file", required=True, type=click.Path(exists=True, path_type=Path),
              help="Conversations as tools/compress/chat_answers writes them.")
@click.option("--max-new", type=int, help="Score the first N tokens of each reply (the length a run generates).")
@click.option("--limit", type=int, help="Only the first N conversations.")
@click.option("--head-checkpoint", type=click.Path(exists=True, path_type=Path),
              help="The trained head (engine-compress --eagle's folder): evaluate_head beside the engine's figure.")
@click.option("--target-checkpoint", type=click.Path(exists=True, path_type=Path),
              help="The target's HF checkpoint the head was trained on (with --head-checkpoint).")
def main(engine, text_file, max_new, limit, head_checkpoint, target_checkpoint) -> None:
    """Print the engine head's teacher-forced acceptance on the replies (and the trained head's, when named)."""
    if (head_checkpoint is None) != (target_checkpoint is None):
        raise click.UsageError("--head-checkpoint and --target-checkpoint go together")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine)  # the engine folder holds the target's tokenizer files
    convs = conversations(tokenizer, text_file.read_text(encoding="utf-8"), max_new)[:limit]
    llm = LLM(engine)
    try:
        counts = [score_engine(llm, ids, reply)[:2] for ids, reply in convs]
    finally:
        llm.close()
    report = {"conversations": len(convs), "engine": figures(sum(c[0] for c in counts), sum(c[1] for c in counts))}
    if head_checkpoint is not None:
        report["offline"] = score_offline(head_checkpoint, target_checkpoint, convs)
    click.echo(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
