"""The builder's kernel table (builder/quant/kernels.py) measured on this CPU: each (bits, block, accuracy_level)
choice of MatMulNBits timed at batch 1 over a model's shapes streaming from memory (tools/bench/matmul_nbits.py's
sweep, the builder's own quantizer), written as us per million weights under this CPU's instruction set in
builder/data/kernel_table.json (other instruction sets' entries are kept).

    python -m tools.bench.kernel_table [--shapes smollm2] [--bits 4,8] [--blocks 16,32,64,128] [--levels 1,4]
        [--runs 15] [--threads 2] [--out builder/data/kernel_table.json]

Run it alone on the machine (under `flock /tmp/bench.lock` where others benchmark): it is a timing."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click
import onnxruntime as ort

from builder.quant.kernels import NOTED_FLAGS, TABLE_FILE, cpu_flags, cpu_isa
from tools.bench.matmul_nbits import SHAPES, sweep_ms
from tools.bench.measure import int_list


def measure(shapes: str, bits: tuple[int, ...], blocks: tuple[int, ...], levels: tuple[int, ...], threads: int,
            runs: int, log=click.echo) -> dict[str, float]:
    """'bits:block:level' -> us per million weights at M = 1 (asymmetric, as GGUF's repacked types are)."""
    pairs, copies = SHAPES[shapes]
    weights = copies * sum(n * k for n, k in pairs)
    table = {}
    for b in bits:
        for block in blocks:
            for level in levels:
                ms, _ = sweep_ms(shapes, b, block, level, False, 1, threads, runs)
                table[f"{b}:{block}:{level}"] = round(ms * 1e3 / (weights / 1e6), 2)
                log(f"{b}-bit block {block} level {level}: {ms:.2f} ms per sweep, "
                    f"{table[f'{b}:{block}:{level}']} us/Mweight")
    return table


@click.command()
@click.option("--shapes", type=click.Choice(sorted(SHAPES)), default="smollm2", show_default=True)
@click.option("--bits", default="4,8", show_default=True)
@click.option("--blocks", default="16,32,64,128", show_default=True)
@click.option("--levels", default="1,4", show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--runs", default=15, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=TABLE_FILE, show_default=True)
def main(shapes: str, bits: str, blocks: str, levels: str, threads: int, runs: int, out: Path) -> None:
    flags = cpu_flags()
    isa = cpu_isa(flags)
    table = measure(shapes, int_list(bits), int_list(blocks), tuple(int(v) for v in levels.split(",")), threads, runs)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data[isa] = {"measured": f"{time.strftime('%Y-%m-%d')}, onnxruntime {ort.__version__}, {threads} threads, "
                             f"shapes {shapes}, M 1, flags {' '.join(sorted(flags & set(NOTED_FLAGS)))}",
                 "us_per_mweight": table}
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    click.echo(f"{isa}: {len(table)} figures written to {out}")


if __name__ == "__main__":
    main()
