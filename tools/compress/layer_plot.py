"""Which layers the importance scores choose, beside what removing each one costs: block importance
(1 - cos(input, output)) from calibration text (stdlib training files) and the held-out loss increase when each
layer alone is skipped (stdlib held-out files), one bar pair per layer; the layers a `--layers N` plan keeps under
each metric are listed in the JSON and marked in the plot.

    python -m tools.compress.layer_plot --teacher /tmp/smollm2-f32 --keep 15 --out /tmp/layers
"""
from __future__ import annotations

import json
from pathlib import Path

import click
import torch

from builder.compress.checkpoint import load_model, load_tokenizer
from builder.compress.data import load_windows
from builder.compress.importance import activation_scores, perplexity_scores
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


@click.command()
@click.option("--teacher", default="checkpoints/trained/target", show_default=True)
@click.option("--keep", type=int, default=2, show_default=True, help="Layers a plan keeps (marked).")
@click.option("--windows", default=16, show_default=True, help="Calibration and held-out windows each.")
@click.option("--seq-len", default=128, show_default=True)
@click.option("--threads", type=int)
@click.option("--out", required=True, type=click.Path(path_type=Path))
def main(teacher, keep, windows, seq_len, threads, out) -> None:
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(Path(teacher)), load_tokenizer(Path(teacher))
    calib = load_windows(tokenizer, training_files()[::25], seq_len, windows)
    heldout = load_windows(tokenizer, heldout_files(), seq_len, windows)
    scores = activation_scores(model, calib)
    block, cost = scores.layers_block.tolist(), perplexity_scores(model, heldout).tolist()
    rank = lambda values: sorted(sorted(range(len(values)), key=lambda i: -values[i])[:keep])  # noqa: E731
    result = {"teacher": teacher, "keep": keep, "block_importance": block, "heldout_loss_increase": cost,
              "kept_by_block": rank(block), "kept_by_perplexity": rank(cost),
              "head_group_importance": scores.heads.tolist()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "layers.json").write_text(json.dumps(result, indent=1))
    _plot(block, cost, keep, out / "layers.png")
    print(json.dumps({k: result[k] for k in ("kept_by_block", "kept_by_perplexity")}))


if __name__ == "__main__":
    main()
