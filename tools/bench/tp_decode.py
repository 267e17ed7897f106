"""Decode tokens/s of an engine, tensor-parallel or not, and for a TP engine the share of a step spent in
all-reduces on rank 0 (runtime.tensor_parallel.RankEngine.reduce_seconds).

    python -m tools.bench.tp_decode --engine engines/llama7b-int8-tp1 --threads 2
    python -m tools.bench.tp_decode --engine engines/llama7b-int8-tp2 --threads 1   # per rank
"""
from __future__ import annotations

import json
import statistics
import time

import click

from runtime.engine import LLM
from runtime.params import SamplingParams


@click.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--threads", type=int, default=None, help="ONNX Runtime threads (per rank for a TP engine).")
@click.option("--prompt-tokens", type=int, default=16, show_default=True)
@click.option("--new-tokens", type=int, default=16, show_default=True)
@click.option("--runs", type=int, default=3, show_default=True)
def main(engine_dir: str, threads: int | None, prompt_tokens: int, new_tokens: int, runs: int) -> None:
    """Median decode tokens/s over `runs` greedy generations at batch 1 (prompt excluded), as JSON."""
    llm = LLM(engine_dir, max_batch_size=1, threads=threads)
    prompt = list(range(5, 5 + prompt_tokens))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    rates, shares = [], []
    try:
        llm.generate([prompt], SamplingParams(max_new_tokens=2, ignore_eos=True))  # bind the call shapes
        for _ in range(runs):
            engine = getattr(llm.runner, "engine", None)
            before = engine.reduce_seconds if engine else 0.0
            start = time.perf_counter()
            m = llm.generate([prompt], params)[0].metrics
            total = time.perf_counter() - start
            rates.append((m["output_tokens"] - 1) / (m["latency_s"] - m["ttft_s"]))
            shares.append((engine.reduce_seconds - before) / total if engine else 0.0)
    finally:
        llm.close()
    tp = llm.manifest.tensor_parallel.size if llm.manifest.tensor_parallel else 1
    click.echo(json.dumps({"engine": engine_dir, "tensor_parallel": tp, "threads_per_rank": threads,
                           "decode_tok_s": round(statistics.median(rates), 3), "runs": [round(r, 3) for r in rates],
                           "all_reduce_share": round(statistics.median(shares), 4)}))


if __name__ == "__main__":
    main()
