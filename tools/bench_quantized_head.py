"""Decode tokens/s of int4 engines with the lm_head kept float and with it quantized (the tied
embedding then read by row from the same bytes), next to onnxruntime-genai's int4 build (which shares
its embeddings the same way) and transformers, side by side in one run of tools/bench_decode's harness:

    python -m tools.bench_quantized_head --preset llama1b --runs 3

llama.cpp q4_0 is not part of this run (see docs/BENCHMARKS.md for why)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from tools.bench.decode import Workload, print_report, run_benchmark
from tools.make_checkpoint import PRESETS

INT4 = ["quantization.mode=int4_rtn", "quantization.group_size=32", "quantization.exclude=[]"]
VARIANTS = [
    ("engine int4, float lm_head", INT4 + ["quantization.lm_head=none"]),
    ("engine int4, int4 lm_head", INT4),
]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="llama1b", show_default=True)
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench_results/decode"),
              show_default=True)
def main(preset: str, runs: int, workdir: Path) -> None:
    """int4 decode at batch 1 (prompt 16, 16 new tokens, 2 threads) with a float vs a quantized lm_head,
    beside onnxruntime-genai int4: a short run, sized for a 1B model on a small CPU."""
    work = Workload(preset, (1,), prompt_len=16, new_tokens=16, runs=runs, threads=2)
    command = "python -m tools.bench_quantized_head " + shlex.join(sys.argv[1:])
    print_report(run_benchmark(work, workdir, VARIANTS, ("int4",), command, log=click.echo))


if __name__ == "__main__":
    main()
