"""Which layers the importance scores choose, beside what removing each one costs: block importance
(1 - cos(input, output)) from calibration text (stdlib training files) and the held-out loss increase when each
layer alone is skipped (stdlib held-out files), one bar pair per layer; the layers a `--layers N` plan keeps under
each metric are listed in the JSON and marked in the plot. With --keep-heads N, the same for attention heads in
whole KV groups: each group's activation importance beside the held-out loss increase when its heads alone are
silenced (layers x groups forward passes), in heads.png, and how often the two agree on the groups a `--heads N`
plan keeps.

    python -m tools.compress.layer_plot --teacher /tmp/smollm2-f32 --keep 15 --keep-heads 6 --out /tmp/layers
"""
from __future__ import annotations

import json
from pathlib import Path

import click
import torch

from builder.compress.checkpoint import load_model, load_tokenizer
from builder.compress.data import load_windows
from builder.compress.importance import activation_scores, head_perplexity_scores, perplexity_scores
from tools.corpus import heldout_files, training_files


def _plot(block: list[float], cost: list[float], keep: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = range(len(block))
    kept = set(sorted(range(len(block)), key=lambda i: -block[i])[:keep])
    fig, left = plt.subplots(figsize=(max(6, len(block) * 0.35), 4))
    right = left.twinx()
    left.bar([i - 0.2 for i in layers], block, 0.4, color=["C0" if i in kept else "C7" for i in layers],
             label="block importance (1 - cos)")
    right.bar([i + 0.2 for i in layers], cost, 0.4, color="C3", label="held-out loss increase when skipped")
    left.set(xlabel="layer (grey: dropped by block importance)", ylabel="1 - cos(in, out)")
    right.set(ylabel="loss increase (nats)")
    fig.legend(loc="upper right")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def _top(values: list[float], keep: int) -> list[int]:
    return sorted(sorted(range(len(values)), key=lambda i: -values[i])[:keep])


def head_choices(importance: list[list[float]], cost: list[list[float]], keep_groups: int) -> dict:
    """The KV groups each layer keeps by activation importance and by measured cost, and the share of layers
    where the two keep the same groups."""
    by_importance = [_top(row, keep_groups) for row in importance]
    by_cost = [_top(row, keep_groups) for row in cost]
    same = sum(a == b for a, b in zip(by_importance, by_cost))
    return {"kept_by_importance": by_importance, "kept_by_cost": by_cost, "layers_agreeing": same / len(cost)}


def _plot_heads(importance: list[list[float]], cost: list[list[float]], kept: list[list[int]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = len(cost[0])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, len(cost) * 0.4), 6), sharex=True)
    width = 0.8 / groups
    for g in range(groups):
        xs = [i - 0.4 + (g + 0.5) * width for i in range(len(cost))]
        shade = [f"C{g}" if g in kept[i] else "C7" for i in range(len(cost))]
        top.bar(xs, [row[g] for row in importance], width, color=shade)
        bottom.bar(xs, [row[g] for row in cost], width, color=shade, label=f"KV group {g}")
    top.set(ylabel="head-output norm (importance)", title="attention KV groups (grey: dropped by importance)")
    bottom.set(xlabel="layer", ylabel="loss increase when silenced")
    bottom.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


@click.command()
@click.option("--teacher", default="checkpoints/trained/target", show_default=True)
@click.option("--keep", type=int, default=2, show_default=True, help="Layers a plan keeps (marked).")
@click.option("--keep-heads", type=int, help="Heads a plan keeps per layer: measure and plot the KV groups too.")
@click.option("--gguf-file", help="The teacher is this GGUF file inside --teacher.")
@click.option("--windows", default=16, show_default=True, help="Calibration and held-out windows each.")
@click.option("--seq-len", default=128, show_default=True)
@click.option("--threads", type=int)
@click.option("--out", required=True, type=click.Path(path_type=Path))
def main(teacher, keep, keep_heads, gguf_file, windows, seq_len, threads, out) -> None:
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(Path(teacher), gguf_file=gguf_file), load_tokenizer(Path(teacher), gguf_file)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    if keep_heads is not None and (keep_heads % group or not 0 < keep_heads <= model.config.num_attention_heads):
        raise click.BadParameter(f"heads are kept in whole KV groups of {group}: give a multiple of {group} up to "
                                 f"{model.config.num_attention_heads}, got {keep_heads}", param_hint="--keep-heads")
    calib = load_windows(tokenizer, training_files()[::25], seq_len, windows)
    heldout = load_windows(tokenizer, heldout_files(), seq_len, windows)
    scores = activation_scores(model, calib)
    block, cost = scores.layers_block.tolist(), perplexity_scores(model, heldout).tolist()
    result = {"teacher": teacher, "keep": keep, "block_importance": block, "heldout_loss_increase": cost,
              "kept_by_block": _top(block, keep), "kept_by_perplexity": _top(cost, keep),
              "head_group_importance": scores.heads.tolist()}
    out.mkdir(parents=True, exist_ok=True)
    if keep_heads is not None:
        head_cost = head_perplexity_scores(model, heldout).tolist()
        result |= {"keep_heads": keep_heads, "head_group_loss_increase": head_cost}
        result |= head_choices(result["head_group_importance"], head_cost, keep_heads // group)
        _plot_heads(result["head_group_importance"], head_cost, result["kept_by_importance"], out / "heads.png")
    (out / "layers.json").write_text(json.dumps(result, indent=1))
    _plot(block, cost, keep, out / "layers.png")
    print(json.dumps({k: result[k] for k in ("kept_by_block", "kept_by_perplexity", "layers_agreeing") if k in result}))


if __name__ == "__main__":
    main()
