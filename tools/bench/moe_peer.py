"""Mixture-of-experts decode at batch 1 against llama.cpp at the same precision, side by side in one run of
tools/bench/decode.py's harness: our float32 / int8 / int4 engines against llama.cpp f32 / q8_0 / q4_0 (its
own converter and quantizer, tools/bench/gguf_peer.py) and transformers:

    python -m tools.bench.moe_peer --preset moe1b --runs 3

llama.cpp rows need llama-cpp-python, a bench-only source build; without it their rows say how to install it.
Issue 25's targets: each engine >= 1.0x llama.cpp at its precision, engine float32 >= 3x transformers."""
from __future__ import annotations

import functools
import shlex
import sys
from pathlib import Path

import click

from tools.bench import gguf_peer
from tools.bench.decode import ENGINE_VARIANTS, REFERENCE, Workload, markdown_table, print_report, run_benchmark
from tools.bench.moe import parameter_counts
from tools.checkpoints.make_checkpoint import PRESETS

VARIANTS = (
    gguf_peer.Variant("f32", "llama.cpp f32", ftype="f32"),
    gguf_peer.Variant("q8_0", "llama.cpp q8_0", ftype="q8_0"),
    gguf_peer.Variant("q4_0", "llama.cpp q4_0", ftype="q4_0"),
)
# (ours, theirs, minimum ratio of median decode tok/s)
TARGETS = [("engine fp32", "llama.cpp f32", 1.0), ("engine int8", "llama.cpp q8_0", 1.0),
           ("engine int4", "llama.cpp q4_0", 1.0), ("engine fp32", REFERENCE, 3.0)]
BYTES_PER_WEIGHT = {"engine fp32": 4.0, "engine int8": 1.0 + 4 / 256, "engine int4": 0.5 + 4 / 32,
                    "llama.cpp f32": 4.0, "llama.cpp q8_0": 34 / 32, "llama.cpp q4_0": 18 / 32, REFERENCE: 4.0}


def side_by_side(report: dict) -> tuple[list[str], list[list[str]]]:
    """One row per backend: decode tok/s (median, min, max), TTFT, size on disk, and the weight bytes one
    decoded token reads (active parameters x bytes per weight, scales included) and what that is per second."""
    active = report["parameters"]["active_per_token"]
    header = ["backend", "decode tok/s (median)", "min", "max", "TTFT ms", "on disk MB", "weight MB read per token",
              "GB/s of weights"]
    rows = []
    for r in report["results"]:
        t, build = r["decode_tok_s"], report["builds"].get(r["backend"])
        per_token = active * BYTES_PER_WEIGHT.get(r["backend"], float("nan")) / 1e6
        rows.append([r["backend"], f"{t['median']:.1f}", f"{t['min']:.1f}", f"{t['max']:.1f}",
                     f"{r['ttft_s_median'] * 1e3:.0f}", f"{build['engine_mb']:.0f}" if build else "-",
                     f"{per_token:.0f}", f"{per_token * t['median'] / 1e3:.1f}"])
    why = next((n.split(": ", 1)[1] for n in report["notes"] if n.startswith("llama.cpp")), "not measured")
    rows += [[v.label, why, "", "", "", "", "", ""] for v in VARIANTS if v.label not in report["backends"]]
    return header, rows


def target_lines(report: dict) -> list[str]:
    med = {r["backend"]: r["decode_tok_s"]["median"] for r in report["results"]}
    lines = []
    for ours, theirs, want in TARGETS:
        if ours not in med or theirs not in med:
            lines.append(f"{ours} / {theirs}: not measured (target >= {want}x)")
            continue
        ratio = med[ours] / med[theirs]
        lines.append(f"{ours} / {theirs}: {ratio:.2f}x (target >= {want}x: {'meets' if ratio >= want else 'MISSES'})")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--preset", type=click.Choice(sorted(p for p, v in PRESETS.items() if "moe" in v.get("family", ""))),
              default="moe1b", show_default=True)
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench_results/decode"),
              show_default=True)
@click.option("--llama-cpp/--no-llama-cpp", default=True, show_default=True,
              help="Add llama.cpp rows (llama-cpp-python, GGUFs cached under <workdir>/gguf).")
def main(preset: str, runs: int, prompt_len: int, new_tokens: int, workdir: Path, llama_cpp: bool) -> None:
    """MoE decode at batch 1 (2 threads): engines float32/int8/int4 beside llama.cpp f32/q8_0/q4_0 and
    transformers."""
    work = Workload(preset, (1,), prompt_len=prompt_len, new_tokens=new_tokens, runs=runs, threads=2)
    command = "python -m tools.bench.moe_peer " + shlex.join(sys.argv[1:])
    peers = (functools.partial(gguf_peer.peer, variants=VARIANTS),) if llama_cpp else ()
    report = run_benchmark(work, workdir, ENGINE_VARIANTS, (), command, log=click.echo, peers=peers)
    print_report(report)
    counts = parameter_counts(report["checkpoint"])
    click.echo(f"\nparameters: {counts['total'] / 1e9:.3f}B, read per decoded token {counts['active_per_token'] / 1e9:.3f}B")
    click.echo("\n" + markdown_table(*side_by_side(report)) + "\n\n" + "\n".join(target_lines(report)))


if __name__ == "__main__":
    main()
