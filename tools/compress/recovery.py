"""Half-depth recovery curve: prune a teacher to --layers, then train the same pruned student with cross-entropy
only and with distillation (KL on the teacher's logits) for the same steps, on the stdlib training files; held-out
perplexity (stdlib held-out files) along the way, against the teacher's and the pruned-untrained student's.

    python -m tools.compress.recovery --teacher checkpoints/trained/target --layers 2 --methods kd,ce --out /tmp/rec
    python -m tools.compress.recovery --out /tmp/rec --report   # table + plot from the runs' compress.json
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import click
import torch

from builder.compress.checkpoint import load_model, load_tokenizer
from builder.compress.cli import TextSpec, compress
from builder.compress.data import load_windows
from builder.compress.distill import STATE_FILE, DistillConfig, evaluate
from builder.compress.plan import PrunePlan
from tools.corpus import heldout_files, training_files

METHODS = {"kd": dict(kd_weight=1.0, ce_weight=0.0), "ce": dict(kd_weight=0.0, ce_weight=1.0),
           "kd+ce": dict(kd_weight=1.0, ce_weight=1.0)}


def _history(run: Path) -> dict | None:
    """A run's figures: its compress.json, or for a run stopped early its last saved training state."""
    if (run / "compress.json").is_file():
        return json.loads((run / "compress.json").read_text())
    state = run / "train" / STATE_FILE
    return {"history": torch.load(state, weights_only=False)["history"]} if state.is_file() else None


def _gap(ppl: float, untrained: float, teacher: float) -> float:
    """The share of the log-perplexity gap between the pruned-untrained student and the teacher closed at `ppl`."""
    return (math.log(untrained) - math.log(ppl)) / (math.log(untrained) - math.log(teacher))


def at(history: list[dict], key: str, x: float) -> float | None:
    """Held-out perplexity at `x` tokens or seconds, linear in log-perplexity between evaluations (None outside)."""
    points = [(h[key], math.log(h["heldout_ppl"])) for h in history]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1)
    return None


def crossing(history: list[dict], key: str, share: float, untrained: float, teacher: float) -> float | None:
    """The first `key` (tokens or seconds) where the recovered share of the gap reaches `share`, interpolated."""
    points = [(h[key], _gap(h["heldout_ppl"], untrained, teacher)) for h in history]
    for (x0, g0), (x1, g1) in zip(points, points[1:]):
        if g0 < share <= g1:
            return x0 + (x1 - x0) * (share - g0) / (g1 - g0)
    return points[0][0] if points and points[0][1] >= share else None


def _table(runs: dict, key: str, untrained: float, teacher: float) -> list[str]:
    """Every method's held-out perplexity and gap at each evaluation point of any method, by `key`."""
    xs = sorted({h[key] for run in runs.values() for h in run["history"]})
    head = f"| {key} | " + " | ".join(f"{m}: ppl | {m}: gap" for m in runs) + " |"
    lines = [head, "|---|" + "---|---|" * len(runs)]
    for x in xs:
        cells = []
        for run in runs.values():
            ppl = at(run["history"], key, x)
            cells.append("- | -" if ppl is None else f"{ppl:.2f} | {_gap(ppl, untrained, teacher):.1%}")
        lines.append(f"| {x:,.0f} | " + " | ".join(cells) + " |")
    return lines


TIME_KEYS = {"tokens": "training tokens", "seconds": "wall seconds (contended)",
             "active_seconds": "wall seconds, pauses excluded", "cpu_seconds": "the run's CPU seconds"}


def _report(out: Path) -> None:
    teacher = json.loads((out / "teacher.json").read_text())["heldout_ppl"]
    runs = {d.name: _history(d) for d in sorted(out.iterdir()) if d.is_dir() and _history(d)}
    untrained = next(iter(runs.values()))["history"][0]["heldout_ppl"]
    keys = [k for k in TIME_KEYS if all(k in h for run in runs.values() for h in run["history"])]
    lines = [f"teacher held-out ppl {teacher:.2f}, pruned untrained {untrained:.2f}", "",
             "| method | step | " + " | ".join(TIME_KEYS[k] for k in keys) +
             " | held-out ppl | held-out KL | gap recovered (log-ppl) |", "|---|---|" + "---|" * (len(keys) + 3)]
    for name, run in runs.items():
        for h in run["history"]:
            lines.append(f"| {name} | {h['step']} | " + " | ".join(f"{h[k]:,.0f}" for k in keys) +
                         f" | {h['heldout_ppl']:.2f} | {h['heldout_kl']:.4f} | "
                         f"{_gap(h['heldout_ppl'], untrained, teacher):.1%} |")
    for key in keys:
        lines += ["", f"At equal {TIME_KEYS[key]} (between evaluations: interpolated in log-perplexity):", ""]
        lines += _table(runs, key, untrained, teacher)
    lines.append("")
    for name, run in runs.items():
        half = {k: crossing(run["history"], k, 0.5, untrained, teacher) for k in keys}
        lines.append(f"{name}: half of the gap " + ("not reached" if half["tokens"] is None else "after " + ", ".join(
            f"{v:,.0f} {TIME_KEYS[k]}" for k, v in half.items())))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(out, runs, teacher, keys)


def _plot(out: Path, runs: dict, teacher: float, keys: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), sharey=True)
    for ax, key in zip(axes, keys):
        for name, run in runs.items():
            ax.plot([h[key] for h in run["history"]], [h["heldout_ppl"] for h in run["history"]], "o-", label=name)
        ax.axhline(teacher, color="k", ls="--", label="teacher")
        ax.set(xlabel=TIME_KEYS[key], ylabel="held-out perplexity", yscale="log", title=f"recovery by {key}")
        ax.legend()
    fig.savefig(out / "recovery.png", dpi=120, bbox_inches="tight")


@click.command()
@click.option("--teacher", default="checkpoints/trained/target", show_default=True)
@click.option("--gguf-file")
@click.option("--layers", type=int, default=2, show_default=True)
@click.option("--methods", default="kd,ce", show_default=True)
@click.option("--steps", default=60, show_default=True)
@click.option("--batch-size", default=8, show_default=True)
@click.option("--seq-len", default=64, show_default=True)
@click.option("--lr", default=2e-3, show_default=True)
@click.option("--eval-every", default=10, show_default=True)
@click.option("--files-every", default=5, show_default=True, help="Every n-th stdlib training file is text.")
@click.option("--heldout-windows", default=16, show_default=True)
@click.option("--threads", type=int)
@click.option("--max-minutes", default=0.0, show_default=True,
              help="End each run at the first step past this much wall time (0: run all --steps).")
@click.option("--out", required=True, type=click.Path(path_type=Path))
@click.option("--report", is_flag=True, help="Only gather the runs in --out into report.md and recovery.png.")
def main(teacher, gguf_file, layers, methods, steps, batch_size, seq_len, lr, eval_every, files_every,
         heldout_windows, threads, max_minutes, out, report) -> None:
    if threads:
        torch.set_num_threads(threads)
    if report:
        return _report(out)
    text = tuple(str(p) for p in training_files()[::files_every])
    heldout = tuple(str(p) for p in heldout_files())
    spec = TextSpec(text, heldout, seq_len, calib_windows=16, heldout_windows=heldout_windows)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "teacher.json").is_file():
        rows = load_windows(load_tokenizer(Path(teacher), gguf_file), list(heldout), seq_len, heldout_windows)
        (out / "teacher.json").write_text(json.dumps(evaluate(load_model(Path(teacher), gguf_file=gguf_file), None,
                                                              rows, "cpu")))
    for method in methods.split(","):
        cfg = DistillConfig(steps=steps, batch_size=batch_size, lr=lr, warmup=max(1, steps // 20),
                            eval_every=eval_every, save_every=eval_every, max_minutes=max_minutes,
                            **METHODS[method])
        compress(teacher, out / method, PrunePlan(layers=layers), cfg, spec, gguf_file=gguf_file)


if __name__ == "__main__":
    main()
