"""The measurements of tools.bench.gpu_check, one function each: copy bandwidth, engine builds, decode tok/s,
the executor's step against the raw runner step with and without overlap (issue 28), transformers eager and
static cache + torch.compile, concurrency, tp2 on one device, memory after load, and (issue 29) a paged engine's
greedy tokens and concurrency against its GQA twin (paged_check)."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from unittest import mock

import numpy as np

ONE_B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
             vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=False, head_dim=64)
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


def step_overhead(engine: Path, device: str, new_tokens: int, repeats: int) -> dict:
    """Issue 28: the batch-1 decode step through the executor (LLM's path) with overlap off, on (one step at a
    time) and on with steps run ahead (lookahead, default 16: the next step fed on the engine thread), each against the raw
    runner step of the same engine (on CUDA its captured graph), the modes alternating over `repeats` rounds; and
    whether the three give the same tokens (tools/bench/step_breakdown.py `overlap_modes`)."""
    from tools.bench.step_breakdown import overlap_modes

    return overlap_modes(engine, 1, new_tokens, repeats, device=device)


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


def paged_check(tmp: Path, checkpoint: Path, prompts: list[list[int]], new_tokens: int = 16,
                rows: int | None = None) -> tuple[str, int, int]:
    """Issue 29 (CUDA): a paged fp16 engine (PagedAttention over the scheduler's blocks, packed steps) against
    its GQA fp16 twin, both through LLM.generate: the first prompt alone, then all of them (so prompts that
    share its prefix reuse it: by reference on the paged engine, by copy on the GQA one). Returns the verdict
    ("identical", else the share of tokens that agree and both), and the most sequences each engine ran at
    once on the KV memory of `rows` (default: len(prompts)) max_seq_len rows: the GQA engine's slots, the
    paged engine's blocks (with rows enough for every prompt)."""
    from runtime.engine import LLM

    rows = rows or len(prompts)
    longest = max(len(p) for p in prompts) + new_tokens + 16
    gqa, _ = build(checkpoint, tmp / "gqa-fp16", "cuda", "float16", "none", rows, longest)
    paged, _ = build(checkpoint, tmp / "paged-fp16", "cuda", "float16", "none", len(prompts), longest,
                     "target.attention=paged")
    gqa_llm = LLM(gqa, device="cuda")
    budget_mb = gqa_llm.spec.bytes / 2**20  # what the GQA engine's rows take on the device
    want, gqa_peak = _two_waves(gqa_llm, prompts, new_tokens)
    got, paged_peak = _two_waves(LLM(paged, device="cuda", kv_memory_mb=budget_mb), prompts, new_tokens)
    if got == want:
        return "identical", gqa_peak, paged_peak
    agree = np.mean([a == b for x, y in zip(want, got) for a, b in zip(x, y)])
    return f"DIFFER ({agree:.0%} of tokens agree): gqa {want} paged {got}", gqa_peak, paged_peak


def _two_waves(llm, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], int]:
    """Greedy tokens of prompts[0] alone, then of every prompt at once; the most sequences running at once."""
    from runtime.request.params import SamplingParams

    params, peak = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), [0]

    def watch(output):  # on the executor thread, under its lock
        peak[0] = max(peak[0], len(llm.executor.scheduler.running))

    try:
        first = llm.generate(prompts[:1], params)[0].token_ids
        handles = [llm.executor.submit_sequence(llm.make_sequence(p, params), watch) for p in prompts]
        return [first] + [h.result(timeout=600).token_ids for h in handles], peak[0]
    finally:
        llm.close()


def memory_after_load(engine: Path, device: str) -> dict[str, float]:
    """Device memory an engine takes at load (CUDA: free memory before minus after, the whole device; CPU:
    resident set growth) against what it must hold: its weight bytes plus its KV cache bytes."""
    from runtime.engine import LLM

    before = _used_bytes(device)
    llm = LLM(engine, device=device)
    used = _used_bytes(device) - before
    kv = llm.runner.spec.bytes
    llm.close()
    weights = sum(f.stat().st_size for f in engine.glob("*.onnx.data"))
    return {"used_gb": used / 1e9, "weights_gb": weights / 1e9, "kv_gb": kv / 1e9,
            "ratio": used / max(1, weights + kv)}


def _used_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
