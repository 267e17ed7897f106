"""The measurements tools.gpu.check runs, one function each, through the runtime's public API (LLM, the engine
builder, the runner): engine builds, greedy parity helpers, copy bandwidth, decode tok/s, the executor's step
against the raw runner step (issue 28), concurrency, tensor parallel ranks on one device (issue 16), a paged
engine against its GQA twin (issue 29), and transformers as a peer."""
from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from unittest import mock

import numpy as np

ONE_B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
             vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=False, head_dim=64)
SAME_TRUSTED = "same over the trusted tokens"  # two half-precision engines that part only after a near-tie
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512)


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
    """Build an engine of `checkpoint` into `out` (verification off); (engine dir, seconds). An engine already
    in `out` (its manifest written) is reused: a rerun on the same machine does not build it again; a build
    killed before its manifest was written is started over."""
    from builder.build import build_engine
    from builder.recipe import load_recipe

    if (out / "manifest.json").exists():
        return out, 0.0
    shutil.rmtree(out, ignore_errors=True)
    recipe = load_recipe(base={"model": str(checkpoint)}, overrides=[
        f"target.device={device}", f"target.dtype={dtype}", f"quantization.mode={quant}",
        f"limits.max_seq_len={seq_len}", f"limits.max_batch_size={batch}", "verify.enabled=off", *overrides])
    start = time.perf_counter()
    engine = build_engine(recipe, out, log=lambda _: None)
    return engine, time.perf_counter() - start


def greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens of `prompts` run together through LLM.generate (EOS an ordinary token)."""
    from runtime.request.params import SamplingParams

    return [r.token_ids for r in llm.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))]


def each_alone_and_together(llm, prompts: list[list[int]], new_tokens: int) -> tuple[list, list]:
    """(tokens of every prompt submitted at once as an in-flight batch, tokens of each prompt run alone)."""
    from runtime.request.params import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    together = [h.result(timeout=600).token_ids for h in [llm.submit(p, params) for p in prompts]]
    return together, [greedy(llm, [p], new_tokens)[0] for p in prompts]


def agreement(want: list[list[int]], got: list[list[int]], cut: list[int] | None = None) -> str:
    """"identical", else the share of tokens that agree; with `cut` (each row's trusted length,
    tools/bench/parity.py), "same over the trusted tokens" where the rows agree that far and no further."""
    if want == got:
        return "identical"
    if cut is not None and all(x[:n] == y[:n] for x, y, n in zip(want, got, cut, strict=True)):
        return SAME_TRUSTED
    same = np.mean([a == b for x, y in zip(want, got) for a, b in zip(x, y)] or [0.0])
    return f"DIFFER ({same:.0%} of tokens agree)"


def decode_tok_s(llm, batch: int, new_tokens: int, repeats: int) -> float:
    """Greedy decode tokens/s for `batch` prompts of 16 tokens (prefill excluded), median after a warm-up."""
    from tools.bench.measure import median_decode_tok_s

    prompts = [[3 + (i * 7 + j) % 200 for j in range(16)] for i in range(batch)]
    return median_decode_tok_s(llm, prompts, new_tokens, repeats)


def step_overhead(engine: Path, device: str, new_tokens: int, repeats: int) -> dict:
    """Issue 28: the batch-1 decode step through the executor (LLM's path) with overlap off, on (one step at a
    time) and on with steps run ahead, each against the raw runner step of the same engine (on CUDA its captured
    graph), and whether the three give the same tokens (tools/bench/step_breakdown.py `overlap_modes`)."""
    from tools.bench.step_breakdown import overlap_modes

    return overlap_modes(engine, 1, new_tokens, repeats, device=device)


def transformers_tok_s(checkpoint: Path, device: str, batch: int, new_tokens: int, repeats: int) -> float:
    """transformers eager greedy decode tok/s (prefill excluded), fp16 on CUDA, float32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    ids = torch.tensor([[3 + (i * 7 + j) % 200 for j in range(16)] for i in range(batch)], device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
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
    prompts = [rng.integers(3, 200, int(n)).tolist() for n in rng.integers(16, max_prompt + 1, requests)]
    llm.generate([prompts[0]], params)  # a warm-up: the first call of an engine pays its sessions' setup
    start = time.perf_counter()
    single = llm.generate([prompts[0]], params)[0]
    single_rate = new_tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    handles = [llm.submit(p, params) for p in prompts]
    results = [h.result(timeout=3600) for h in handles]
    rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
    assert single.token_ids, "single stream produced nothing"
    return rate, single_rate, statistics.median(r.metrics["ttft_s"] for r in results)


def prefill_seconds(llm, lengths: list[int], repeats: int) -> list[tuple[int, float, float]]:
    """(prompt length, first call s, median of `repeats` later calls s) of a batch-1 prefill on row 0 at each
    length: the first call of a shape pays ONNX Runtime's per-shape setup, the later ones are the steady cost."""
    rows = []
    for n in lengths:
        prompt = [3 + (7 * j) % 200 for j in range(n)]
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            llm.runner.prefill(0, [prompt])
            times.append(time.perf_counter() - start)
        rows.append((n, times[0], statistics.median(times[1:])))
    return rows


def tp2_on_one_device(checkpoint: Path, tmp: Path, device: str, dtype: str, prompts: list[list[int]],
                      new_tokens: int = 16) -> str:
    """Issue 16: a tp2 engine's ranks both on `device` (one GPU), all-reducing with gloo
    (ENGINE_TP_BACKEND=gloo; NCCL refuses two ranks on one GPU): "identical" when its greedy tokens for a
    ragged batch are the tp1 engine's (same dtype), else the share of tokens that agree."""
    with mock.patch.dict(os.environ, {"ENGINE_TP_BACKEND": "gloo"}):  # the tp2 engine's worker inherits it
        tokens = split_twins(checkpoint, tmp, device, dtype, prompts, new_tokens, "tensor_parallel", {"tp2": {}})
    return agreement(tokens["tp1"], tokens["tp2"])


def pp2_on_one_device(checkpoint: Path, tmp: Path, device: str, dtype: str, prompts: list[list[int]],
                      new_tokens: int = 16) -> dict[str, str]:
    """Issue 50: a pp2 engine's stages both on `device` (one GPU; hidden states through host memory over gloo)
    against the pp1 engine: the verdict ("identical", else the share of tokens that agree) with one micro-batch
    (pp1's call shapes) and with the default two (the batch split between them)."""
    loads = {"pp2, 1 micro-batch": {"micro_batches": 1}, "pp2, 2 micro-batches": {}}
    tokens = split_twins(checkpoint, tmp, device, dtype, prompts, new_tokens, "pipeline_parallel", loads)
    return {name: agreement(tokens["pp1"], tokens[name]) for name in loads}


def split_twins(checkpoint: Path, tmp: Path, device: str, dtype: str, prompts: list[list[int]], new_tokens: int,
                setting: str, loads: dict[str, dict]) -> dict[str, list[list[int]]]:
    """Greedy tokens of a ragged batch on the engine built with parallel.`setting` 1 ("tp1" / "pp1") and, per
    `loads` (name -> LLM options), on its twin built with 2."""
    from runtime.engine import LLM

    short, tokens = {"tensor_parallel": "tp", "pipeline_parallel": "pp"}[setting], {}
    seq_len = max(len(p) for p in prompts) + new_tokens + 8
    for name, options in {f"{short}1": {}, **loads}.items():
        size = 1 if name == f"{short}1" else 2
        engine, _ = build(checkpoint, tmp / f"{short}{size}", device, dtype, "none", len(prompts), seq_len,
                          f"parallel.{setting}={size}")
        llm = LLM(engine, device=device, **options)
        try:
            tokens[name] = greedy(llm, prompts, new_tokens)
        finally:
            llm.close()
    return tokens


def paged_check(gqa: Path, paged: Path, prompts: list[list[int]], new_tokens: int, rows: int,
                device: str = "cuda", cut: list[int] | None = None) -> tuple[str, int, int]:
    """Issue 29: a paged engine (PagedAttention over the scheduler's blocks, packed steps) against its GQA twin,
    both through LLM: the first prompt alone, then all of them at once (prompts that share its prefix reuse it:
    by reference on the paged engine, by copy on the GQA one). The GQA engine is loaded with `rows` slots and
    the paged one on the KV memory those rows take. Returns the verdict (`agreement` over `cut`: the trusted
    lengths of prompts[0] and then of every prompt) and the most sequences each engine ran at once."""
    from runtime.engine import LLM

    gqa_llm = LLM(gqa, device=device, max_batch_size=rows)
    budget_mb = gqa_llm.spec.bytes / 2**20  # what the GQA engine's rows take on the device
    want, gqa_peak = _two_waves(gqa_llm, prompts, new_tokens)
    got, paged_peak = _two_waves(LLM(paged, device=device, kv_memory_mb=budget_mb), prompts, new_tokens)
    return agreement(want, got, cut), gqa_peak, paged_peak


def _two_waves(llm, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], int]:
    """Greedy tokens of prompts[0] alone, then of every prompt at once; the most sequences running at once
    (the executor's public stats, polled while the second wave runs)."""
    import threading

    from runtime.request.params import SamplingParams

    params, peak, done = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], llm.executor.stats()["running"])

    try:
        first = greedy(llm, prompts[:1], new_tokens)[0]
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        handles = [llm.submit(p, params) for p in prompts]
        rest = [h.result(timeout=600).token_ids for h in handles]
        done.set()
        watcher.join()
        return [first] + rest, peak[0]
    finally:
        done.set()
        llm.close()
