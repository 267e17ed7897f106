"""One command for a lent GPU machine: the GPU tests, then the issue's benchmarks side by side, as a table.

    python -m tools.bench.gpu_check                      # on the GPU box (see ../shared/gpu/README.md for its setup)
    python -m tools.bench.gpu_check --device cpu --tiny  # smoke run of the same code on CPU (tests/tools/test_gpu_check.py)

Measured in one run: build time per engine; greedy decode tok/s at batch 1 and 8 for our fp16 (CPU: float32)
and int4 engines, transformers eager and (CUDA) transformers static cache + torch.compile; the copy bandwidth
and the roofline it implies (weight bytes per token / bandwidth); 64 concurrent requests through the executor
(prompts 16-512, 128 new tokens) against one stream, with TTFT p50. Figures are medians of `--repeats` runs.
Also (issue 16): a tiny tp2 engine's two ranks on the one device with gloo generate tp1's greedy tokens."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import click
import numpy as np

ONE_B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
             vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=False, head_dim=64)
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512)


@dataclass
class Report:
    """Rows of (what, figure, note) in the order measured."""

    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, what: str, figure: float | str, note: str = "") -> None:
        self.rows.append((what, f"{figure:.1f}" if isinstance(figure, float) else str(figure), note))

    def print(self, title: str) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for column in ("measurement", "figure", "note"):
            table.add_column(column)
        for row in self.rows:
            table.add_row(*row)
        Console().print(table)


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of 5."""
    if device == "cpu":
        src = np.ones(nbytes // 8, np.float64)
        dst = np.empty_like(src)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - start)
        return 2 * src.nbytes / statistics.median(times)
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 2 / statistics.median(times)


def build(checkpoint: Path, out: Path, device: str, dtype: str, quant: str, batch: int,
          seq_len: int, *overrides: str) -> tuple[Path, float]:
    from builder.build import build_engine
    from builder.recipe import load_recipe

    recipe = load_recipe(base={"model": str(checkpoint)}, overrides=[
        f"target.device={device}", f"target.dtype={dtype}", f"quantization.mode={quant}",
        f"limits.max_seq_len={seq_len}", f"limits.max_batch_size={batch}", "verify.enabled=off", *overrides])
    start = time.perf_counter()
    engine = build_engine(recipe, out, log=lambda _: None)
    return engine, time.perf_counter() - start


def decode_tok_s(llm, batch: int, new_tokens: int, repeats: int) -> float:
    """Greedy decode tokens/s for `batch` prompts of 16 tokens (prefill excluded), median after a warm-up."""
    from tools.bench.measure import median_decode_tok_s

    prompts = [[3 + (i * 7 + j) % 200 for j in range(16)] for i in range(batch)]
    return median_decode_tok_s(llm, prompts, new_tokens, repeats)


def transformers_tok_s(checkpoint: Path, device: str, batch: int, new_tokens: int, repeats: int,
                       compiled: bool) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    ids = torch.tensor([[3 + (i * 7 + j) % 200 for j in range(16)] for i in range(batch)], device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if compiled:
        kwargs.update(cache_implementation="static", compile_config=None)
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    rates = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            first = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            prefill = time.perf_counter() - first
            start = time.perf_counter()
            model.generate(ids, **kwargs)
            rates.append(batch * (new_tokens - 1) / (time.perf_counter() - start - prefill))
    return statistics.median(rates[1:])


def concurrency(llm, requests: int, new_tokens: int, max_prompt: int) -> tuple[float, float, float]:
    """(throughput tok/s of `requests` concurrent mixed-length requests, single-stream tok/s, TTFT p50 s)."""
    from runtime.request.params import SamplingParams

    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [list(rng.integers(3, 200, int(n))) for n in rng.integers(16, max_prompt + 1, requests)]
    start = time.perf_counter()
    single = llm.generate([prompts[0]], params)[0]
    single_rate = new_tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    handles = [llm.submit(p, params) for p in prompts]
    results = [h.result(timeout=3600) for h in handles]
    rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
    assert single.token_ids, "single stream produced nothing"
    return rate, single_rate, statistics.median(r.metrics["ttft_s"] for r in results)


def tp2_on_one_device(tmp: Path, device: str, dtype: str) -> str:
    """Issue 16: a tiny tp2 engine's ranks both on `device` (one GPU), all-reducing with gloo
    (ENGINE_TP_BACKEND=gloo; NCCL refuses two ranks on one GPU): "identical" when its greedy tokens for a
    ragged batch are the tp1 engine's (same dtype), else the share of tokens that agree and both lists."""
    from runtime.engine import LLM
    from runtime.request.params import SamplingParams
    from tools.checkpoints.make_checkpoint import make_checkpoint

    checkpoint = make_checkpoint(tmp / "tp-ckpt", **TINY, initializer_range=0.1, seed=3)
    prompts = [[3 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate((11, 3, 17, 6))]
    tokens = {}
    with mock.patch.dict(os.environ, {"ENGINE_TP_BACKEND": "gloo"}):  # the tp2 engine's worker inherits it
        for tp in (1, 2):
            engine, _ = build(checkpoint, tmp / f"tp{tp}", device, dtype, "none", 4, 64,
                              f"parallel.tensor_parallel={tp}")
            llm = LLM(engine, device=device)
            try:
                results = llm.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
                tokens[tp] = [r.token_ids for r in results]
            finally:
                llm.close()
    if tokens[2] == tokens[1]:
        return "identical"
    agree = np.mean([a == b for x, y in zip(tokens[1], tokens[2]) for a, b in zip(x, y)])
    return f"DIFFER ({agree:.0%} of tokens agree): tp1 {tokens[1]} tp2 {tokens[2]}"


def run_gpu_tests() -> int:
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/runtime/test_gpu.py"])


@click.command()
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--tiny", is_flag=True, help="Tiny model and short runs (a smoke test of this tool).")
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--skip-tests", is_flag=True, help="Benchmarks only.")
@click.option("--skip-peers", is_flag=True, help="Leave out transformers.")
def main(device: str, tiny: bool, repeats: int, skip_tests: bool, skip_peers: bool) -> None:
    """GPU tests + benchmarks of issue 15, printed as one table."""
    from runtime.engine import LLM
    from tools.checkpoints.make_checkpoint import make_checkpoint

    report = Report()
    if device == "cuda" and not skip_tests:
        report.add("pytest -m gpu tests/runtime/test_gpu.py", "passed" if run_gpu_tests() == 0 else "FAILED")
    new_tokens, requests, max_prompt = (8, 4, 32) if tiny else (128, 64, 512)
    fp = "float16" if device == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        report.add(f"tp2 ranks on one device (gloo), {fp}: greedy vs tp1", tp2_on_one_device(Path(tmp), device, fp))
        checkpoint = make_checkpoint(Path(tmp) / "ckpt", **(TINY if tiny else ONE_B), seed=0)
        bandwidth = copy_bandwidth(device, (1 << 24) if tiny else (1 << 30))
        report.add("copy bandwidth GB/s", bandwidth / 1e9, device)
        ours: dict[str, float] = {}
        for label, quant in ((fp, "none"), ("int4", "int4_rtn")):
            engine, seconds = build(checkpoint, Path(tmp) / label, device, fp, quant, max(8, requests),
                                    max_prompt + new_tokens + 8)
            report.add(f"build {label} s", seconds, "1B shape" if not tiny else "tiny")
            weights = (engine / "model.onnx.data").stat().st_size
            report.add(f"{label} roofline tok/s (batch 1)", bandwidth / weights, f"{weights / 1e9:.2f} GB read/token")
            llm = LLM(engine, device=device)
            for batch in (1, 8):
                ours[f"{label}/{batch}"] = decode_tok_s(llm, batch, new_tokens, repeats)
                report.add(f"ours {label} batch {batch} tok/s", ours[f"{label}/{batch}"],
                           f"{ours[f'{label}/{batch}'] / (bandwidth / weights):.0%} of roofline" if batch == 1 else "")
            if quant == "none":
                rate, single, ttft = concurrency(llm, requests, new_tokens, max_prompt)
                report.add(f"{requests} concurrent tok/s", rate, f"{rate / single:.1f}x single stream ({single:.1f})")
                report.add("TTFT p50 ms", ttft * 1e3)
            llm.close()
        report.add("int4 / fp batch 1", ours["int4/1"] / ours[f"{fp}/1"])
        for compiled in ((False, True) if device == "cuda" else (False,)) if not skip_peers else ():
            name = "transformers static+compile" if compiled else "transformers eager"
            for batch in (1, 8):
                peer = transformers_tok_s(checkpoint, device, batch, new_tokens, repeats, compiled)
                report.add(f"{name} batch {batch} tok/s", peer, f"ours {fp} = {ours[f'{fp}/{batch}'] / peer:.2f}x")
    report.print(f"gpu_check on {device}{' (tiny)' if tiny else ''}")


if __name__ == "__main__":
    main()
