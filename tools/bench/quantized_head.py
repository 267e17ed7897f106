"""Decode tokens/s of int4 engines with the lm_head kept float and with it quantized (the tied
embedding then read by row from the same bytes), next to onnxruntime-genai's int4 build (which shares
its embeddings the same way), llama.cpp q4_0 and transformers, side by side in one run of
tools/bench/decode.py's harness:

    python -m tools.bench.quantized_head --preset llama1b --runs 3

llama.cpp rows (tools/bench/gguf_peer.py) need llama-cpp-python, a bench-only source build; without it
their rows say how to install it. Issue 15's target: int4 lm_head engine / llama.cpp q4_0 >= 1.0x."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from tools.bench import gguf_peer
from tools.bench.decode import Workload, markdown_table, print_report, run_benchmark
from tools.checkpoints.make_checkpoint import PRESETS

INT4 = ["quantization.mode=int4_rtn", "quantization.group_size=32", "quantization.exclude=[]"]
VARIANTS = [
    ("engine int4, float lm_head", INT4 + ["quantization.lm_head=none"]),
    ("engine int4, int4 lm_head", INT4),
]
TARGET = ("engine int4, int4 lm_head", gguf_peer.VARIANTS[0].label, 1.0)


def side_by_side(report: dict) -> tuple[list[str], list[list[str]]]:
    """One row per backend at batch 1 (median, min, max decode tok/s, TTFT, size on disk); a llama.cpp
    row that was not measured says why."""
    header = ["backend", "decode tok/s (median)", "min", "max", "TTFT ms", "on disk MB"]
    rows = []
    for r in report["results"]:
        t, build = r["decode_tok_s"], report["builds"].get(r["backend"])
        rows.append([r["backend"], f"{t['median']:.1f}", f"{t['min']:.1f}", f"{t['max']:.1f}",
                     f"{r['ttft_s_median'] * 1e3:.0f}", f"{build['engine_mb']:.0f}" if build else "-"])
    why = next((n.split(": ", 1)[1] for n in report["notes"] if n.startswith("llama.cpp")), "not measured")
    rows += [[v.label, why, "", "", "", ""] for v in gguf_peer.VARIANTS if v.label not in report["backends"]]
    return header, rows


def target_line(report: dict) -> str:
    num, den, want = TARGET
    med = {r["backend"]: r["decode_tok_s"]["median"] for r in report["results"]}
    if num not in med or den not in med:
        return f"{num} / {den}: not measured (target >= {want}x)"
    ratio = med[num] / med[den]
    return f"{num} / {den}: {ratio:.2f}x (target >= {want}x: {'meets' if ratio >= want else 'MISSES'})"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="llama1b", show_default=True)
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench_results/decode"),
              show_default=True)
@click.option("--llama-cpp/--no-llama-cpp", default=True, show_default=True,
              help="Add llama.cpp q4_0 rows (llama-cpp-python, GGUFs cached under <workdir>/gguf).")
def main(preset: str, runs: int, workdir: Path, llama_cpp: bool) -> None:
    """int4 decode at batch 1 (prompt 16, 16 new tokens, 2 threads) with a float vs a quantized lm_head,
    beside onnxruntime-genai int4 and llama.cpp q4_0: a short run, sized for a 1B model on a small CPU."""
    work = Workload(preset, (1,), prompt_len=16, new_tokens=16, runs=runs, threads=2)
    command = "python -m tools.bench.quantized_head " + shlex.join(sys.argv[1:])
    report = run_benchmark(work, workdir, VARIANTS, ("int4",), command, log=click.echo,
                           peers=(gguf_peer.peer,) if llama_cpp else ())
    print_report(report)
    click.echo("\n" + markdown_table(*side_by_side(report)) + "\n\n" + target_line(report))


if __name__ == "__main__":
    main()
