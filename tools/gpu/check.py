"""The whole GPU check in one call, correctness first, then speed, under a hard deadline:

    python -m tools.gpu.check --quick --out $OUT                  # on the lent GPU (default deadline 420 s)
    python -m tools.gpu.check --quick --device cpu --out /tmp/gc  # the same plan on CPU, small shapes (CI)
    python -m tools.gpu.check --dry-run                           # the planned device calls, bytes, time budget

Every step (STEPS, in order) writes its rows to OUT/check.json as soon as each exists, and everything the steps
print goes to OUT/check.log; the table is printed at the end and written to OUT/table.txt (three files in all).
The steps run in one child process; the parent watches the clock: a step past its own cap, or anything still
running at the deadline, is killed and recorded as TIMEOUT, a step whose process died is FAILED (its exit code
and the log's tail say why) and the next step starts in a fresh process. At the deadline no new step starts:
the parent writes what it has, prints the table and exits 0. Engines and checkpoints live in --work (not in
OUT, which comes back from the machine); a rerun on the same machine reuses the engines already built.

Correctness on the trained model (checkpoints/trained/target, built there), then on a random checkpoint of the
1B shape (Llama-3.2-1B dimensions) made there; speed on that 1B-shape checkpoint. The precision rules are
docs/GPU.md's (tools/bench/parity.py). docs/GPU.md says how the machine is readied and how long each part takes."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import click
import numpy as np

from tools.gpu import headline as h
from tools.gpu import steps as m
from tools.gpu.steps import ONE_B, TINY, build

DEADLINE_S = 420
ROOT = Path(__file__).resolve().parents[2]
TRAINED = ROOT / "checkpoints" / "trained" / "target"
FINAL = ("passed", "measured", "FAILED", "SKIPPED", "TIMEOUT", "not run")  # a step's status once the check ends
INT4_BOUND = 0.4  # relative RMS of int4 first-step logits against float (tests/builder/test_quantized_engines.py)
SNIPPETS = ["def ", "import os\n", "class Parser:\n    def __init__(self", "for i in range(", "return self.",
            "if __name__ == ", "    def __repr__(self):\n        return ", "with open(path) as f:\n    ",
            "try:\n    import ", "raise ValueError(", "from collections import ", "while True:\n    ",
            "    @property\n    def ", "lambda x: ", "except KeyError:\n    ", "print(f\""]
HEADER = ["import argparse\nimport os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser("
          "description=__doc__)\n    parser.add_argument("]  # the prefix a quarter of the paged step's prompts share


@dataclass(frozen=True)
class Plan:
    """One run's settings: where engines live, the device and the sizes (small shapes on CPU)."""

    device: str
    quick: bool
    work: Path

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def dtype(self) -> str:
        return "float16" if self.gpu else "float32"

    @property
    def shape(self) -> dict:  # the speed checkpoint's
        return ONE_B if self.gpu else TINY

    @property
    def new_tokens(self) -> int:
        return (32 if self.quick else 128) if self.gpu else 8

    @property
    def requests(self) -> int:  # concurrent requests in the speed step
        return 64 if self.gpu else 8

    @property
    def longest(self) -> int:  # longest prompt of the concurrency and paged steps
        return (256 if self.quick else 512) if self.gpu else 32

    @property
    def repeats(self) -> int:
        return (3 if self.quick else 5) if self.gpu else 1

    @property
    def seq_len(self) -> int:
        return self.longest + 32 + self.new_tokens + 16

    @property
    def inflight(self) -> int:  # requests of the in-flight batch checked against each alone
        return 16 if self.gpu else 6

    def trained_prompts(self, texts: list[str] = SNIPPETS) -> list[list[int]]:
        """Snippets of Python in the trained model's tokenizer (the first 4: the ragged batch)."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(TRAINED / "tokenizer.json"))
        return [tokenizer.encode(text).ids for text in texts]

    def engine(self, name: str) -> Path:
        return self.work / name


class Report:
    """OUT/check.json: the run's settings and every step's result {status, rows, values, seconds, started},
    rewritten whole (write then rename) whenever a row lands, so a killed process loses nothing written."""

    def __init__(self, out: Path):
        self.path = out / "check.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"settings": {}, "steps": {}}

    @property
    def steps(self) -> dict[str, dict]:
        return self.data["steps"]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    def value(self, step: str, key: str) -> float | None:
        return self.steps.get(step, {}).get("values", {}).get(key)


class Recorder:
    """One step's result as it grows: each row is saved at once."""

    def __init__(self, report: Report, step: str):
        self.report, self.step = report, step
        report.steps[step] = {"status": "running", "rows": [], "values": {}, "seconds": 0.0, "started": time.time()}
        report.save()

    @property
    def result(self) -> dict:
        return self.report.steps[self.step]

    def add(self, what: str, figure: float | str, note: str = "", key: str | None = None) -> None:
        """A row (what, figure, note); a float figure under `key` is also a value later steps read."""
        self.result["rows"].append([what, f"{figure:.1f}" if isinstance(figure, float) else str(figure), note])
        if key is not None and isinstance(figure, float):
            self.result["values"][key] = figure
        self.report.save()

    def verdict(self, what: str, ok: bool, figure: str, note: str = "") -> None:
        """A correctness row; a failing one makes the step FAILED."""
        self.add(what, figure, note)
        if not ok:
            self.result["status"] = "FAILED"

    def finish(self, status: str) -> None:
        result = self.result
        result["status"] = "FAILED" if result["status"] == "FAILED" else status
        result["seconds"] = time.time() - result["started"]
        self.report.save()


# ---- correctness ----------------------------------------------------------------------------------------------

def provider(plan: Plan, r: Recorder) -> None:
    """An ONNX Runtime session opened through the runtime's own check must run on the asked provider."""
    from tools.gpu.setup import check_session

    r.verdict("session providers", True, check_session(plan.device))
    if plan.gpu:
        import torch

        r.add("device", torch.cuda.get_device_name(0), f"torch {torch.__version__}")


def trained_build(plan: Plan, r: Recorder) -> None:
    for label, quant in (("fp", "none"), ("int4", "int4_rtn")):
        _, seconds = build(TRAINED, plan.engine(f"trained-{label}"), plan.device, plan.dtype, quant, 16, plan.seq_len)
        r.add(f"build trained {plan.dtype if label == 'fp' else label} s", seconds, "" if seconds else "built before")


def trained_greedy(plan: Plan, r: Recorder) -> None:
    """Greedy tokens of a ragged batch of 4 against transformers, graphs off and on, and the first step's logits."""
    prompts = plan.trained_prompts()[:4]
    graph_tokens = {}
    for graphs in (False, True):
        graph_tokens[graphs] = _greedy_vs_transformers(plan, r, TRAINED, plan.engine("trained-fp"), prompts,
                                                       f"trained {plan.dtype}, graphs {'on' if graphs else 'off'}",
                                                       graph_decode=graphs)
    r.verdict("trained graphs on vs off", graph_tokens[True] == graph_tokens[False],
              m.agreement(graph_tokens[False], graph_tokens[True]))


@functools.cache
def _references(plan: Plan, checkpoint: Path, prompts: tuple[tuple[int, ...], ...]) -> list:
    from tools.bench.parity import hf_references

    return hf_references(checkpoint, [list(p) for p in prompts], plan.new_tokens, plan.device, plan.dtype)


def references(plan: Plan, checkpoint: Path, prompts: list[list[int]]) -> list:
    """transformers' greedy continuations (tools/bench/parity.py), each computed once per worker process: the
    trained model's for all the in-flight step's prompts at once (the other steps use the first of them)."""
    if checkpoint == TRAINED:
        every = plan.trained_prompts()[:plan.inflight]
        assert prompts == every[:len(prompts)], "the trained model's prompts are the in-flight step's first ones"
        return _references(plan, checkpoint, tuple(map(tuple, every)))[:len(prompts)]
    return _references(plan, checkpoint, tuple(map(tuple, prompts)))


def _greedy_vs_transformers(plan: Plan, r: Recorder, checkpoint: Path, engine: Path, prompts: list[list[int]],
                            what: str, **load) -> list[list[int]]:
    from runtime.engine import LLM
    from tools.bench.parity import GAP_EPS, logits_close, tokens_agree, trusted_length

    refs = references(plan, checkpoint, prompts)
    eps = GAP_EPS[plan.dtype]
    llm = LLM(engine, device=plan.device, **load)
    try:
        logits = [llm.runner.prefill(0, [p])[0] for p in prompts]  # before generate: slot 0 is free
        ours = m.greedy(llm, prompts, plan.new_tokens)
    finally:
        llm.close()
    agree = all(tokens_agree(o, ref, eps) for o, ref in zip(ours, refs))
    close = [logits_close(row, ref, plan.dtype) for row, ref in zip(logits, refs)]
    r.verdict(f"{what}: greedy vs transformers", agree, "same" if agree else "DIFFER",
              f"trusted tokens {[trusted_length(ref, eps) for ref in refs]} of {plan.new_tokens}")
    r.verdict(f"{what}: first-step logits", all(c for c, _ in close), "close" if all(c for c, _ in close) else "FAR",
              f"max diff {max(d for _, d in close):.3g} from float32"
              + (f" (transformers' own {plan.dtype}: {max(ref.noise[0] for ref in refs):.3g})" if refs[0].noise else ""))
    return ours


def trained_int4(plan: Plan, r: Recorder) -> None:
    """The int4 engine: graphs on and off the same tokens; its first-step logits near transformers' float ones."""
    from runtime.engine import LLM

    prompts = plan.trained_prompts()[:4]
    refs = references(plan, TRAINED, prompts)
    tokens = {}
    for graphs in (False, True):
        llm = LLM(plan.engine("trained-int4"), device=plan.device, graph_decode=graphs)
        try:
            if not graphs:
                rows = np.stack([llm.runner.prefill(0, [p])[0] for p in prompts]).astype(np.float32)
            tokens[graphs] = m.greedy(llm, prompts, plan.new_tokens)
        finally:
            llm.close()
    r.verdict("int4 graphs on vs off", tokens[True] == tokens[False], m.agreement(tokens[False], tokens[True]))
    ref = np.stack([x.first_logits for x in refs])
    error = float(np.sqrt(np.mean((rows - ref) ** 2) / np.mean(ref ** 2)))
    r.verdict("int4 first-step logits vs transformers, relative RMS", error <= INT4_BOUND, f"{error:.3f}",
              f"bound {INT4_BOUND}")
    same = np.mean([a == b for o, x in zip(tokens[False], refs) for a, b in zip(o, x.tokens)])
    r.add("int4 greedy tokens equal to transformers' float ones", f"{same:.0%}", "for information")


def inflight(plan: Plan, r: Recorder) -> None:
    """16 requests as one in-flight batch against each alone, over transformers' trusted length (kernels round
    differently by batch size); how many are identical in full."""
    from runtime.engine import LLM
    from tools.bench.parity import GAP_EPS, trusted_length

    prompts = plan.trained_prompts()[:plan.inflight]
    llm = LLM(plan.engine("trained-fp"), device=plan.device)
    try:
        together, alone = m.each_alone_and_together(llm, prompts, plan.new_tokens)
    finally:
        llm.close()
    cut = [trusted_length(ref, GAP_EPS[plan.dtype]) for ref in references(plan, TRAINED, prompts)]
    ok = all(t[:n] == a[:n] for t, a, n in zip(together, alone, cut))
    r.verdict(f"in-flight batch of {len(prompts)} vs each alone", ok, "same" if ok else "DIFFER",
              f"{sum(t == a for t, a in zip(together, alone))} of {len(prompts)} identical in full")


def ahead(plan: Plan, r: Recorder) -> None:
    """Steps run ahead (overlap with its default lookahead) against overlap off: identical tokens."""
    from runtime.engine import LLM

    prompts = plan.trained_prompts()[:4]
    tokens = {}
    for overlap in (False, True):
        llm = LLM(plan.engine("trained-fp"), device=plan.device, overlap=overlap)
        try:
            tokens[overlap] = m.greedy(llm, prompts, plan.new_tokens)
        finally:
            llm.close()
    r.verdict("steps run ahead vs overlap off", tokens[True] == tokens[False], m.agreement(tokens[False], tokens[True]))


def paged(plan: Plan, r: Recorder) -> None:
    """The trained model's paged engine against its GQA engine: 16 prompts (a quarter sharing the first one's
    prefix) on the KV memory of 4 GQA rows."""
    prompts, header = plan.trained_prompts(), plan.trained_prompts(HEADER)[0]
    prompts = [header + p if i % 4 == 0 else p for i, p in enumerate(prompts)]
    if peaks := _paged_vs_gqa(plan, r, TRAINED, "trained", prompts, 4):
        r.add("most sequences at once on 4 GQA rows' KV: GQA / paged", f"{peaks[0]} / {peaks[1]}")


def _paged_vs_gqa(plan: Plan, r: Recorder, checkpoint: Path, label: str, prompts: list[list[int]],
                  rows: int, trusted: bool = False) -> tuple[int, int] | None:
    """Build `label`'s paged float16 engine and compare its greedy tokens with the `label`-fp engine's (m.paged_check)
    on `rows` GQA rows' KV memory; the most sequences each ran at once. With `trusted`, the tokens are compared over
    transformers' trusted lengths (random weights: near-ties that two half-precision engines may break apart). On
    CPU only the build and the references (no paged kernel)."""
    engine, seconds = build(checkpoint, plan.engine(f"{label}-paged"), "cuda", "float16", "none", len(prompts),
                            plan.seq_len, "target.attention=paged")
    r.add(f"build {label} paged float16 s", seconds)
    cut = None
    if trusted:
        from tools.bench.parity import GAP_EPS, trusted_length

        cut = [trusted_length(ref, GAP_EPS[plan.dtype]) for ref in references(plan, checkpoint, prompts[:1] + prompts)]
    if not plan.gpu:
        r.add("paged vs GQA", "SKIPPED", "PagedAttention has no CPU kernel (tests/runtime/test_paged_executor.py)")
        r.result["status"] = "SKIPPED"
        return None
    verdict, gqa_peak, paged_peak = m.paged_check(plan.engine(f"{label}-fp"), engine, prompts, plan.new_tokens, rows,
                                                  cut=cut)
    r.verdict("paged vs GQA, greedy", verdict in ("identical", m.SAME_TRUSTED), verdict,
              f"trusted tokens: {sum(cut)} of {len(cut) * plan.new_tokens}" if cut else "")
    return gqa_peak, paged_peak


def tp2(plan: Plan, r: Recorder) -> None:
    verdict = m.tp2_on_one_device(TRAINED, plan.work / "tp", plan.device, plan.dtype, plan.trained_prompts()[:4],
                                  plan.new_tokens)
    r.verdict(f"tp2 ranks on one device (gloo) vs tp1, trained {plan.dtype}", verdict == "identical", verdict)


def pp_cuda(plan: Plan, r: Recorder) -> None:
    """Issue 50: the trained model as a pp2 engine, both stages on the one GPU, against pp1."""
    verdicts = m.pp2_on_one_device(TRAINED, plan.work / "pp", plan.device, plan.dtype, plan.trained_prompts()[:4],
                                   plan.new_tokens)
    for name, verdict in verdicts.items():
        r.verdict(f"{name} (stages on one device) vs pp1, trained {plan.dtype}", verdict == "identical", verdict)


def big_build(plan: Plan, r: Recorder) -> None:
    from tools.checkpoints.make_checkpoint import make_checkpoint

    checkpoint = plan.work / "big-ckpt"
    start = time.perf_counter()
    if not (checkpoint / "config.json").exists():
        make_checkpoint(checkpoint, **plan.shape, initializer_range=0.1, seed=0, dtype=plan.dtype)
    r.add("make 1B-shape checkpoint s" if plan.gpu else "make small checkpoint s", time.perf_counter() - start)
    _, seconds = build(checkpoint, plan.engine("big-fp"), plan.device, plan.dtype, "none", plan.requests, plan.seq_len)
    r.add(f"build {plan.dtype} s", seconds)


def big_greedy(plan: Plan, r: Recorder) -> None:
    prompts = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate((5, 17, 33, 9))]
    _greedy_vs_transformers(plan, r, plan.work / "big-ckpt", plan.engine("big-fp"), prompts, f"{plan.dtype}")


# ---- speed ------------------------------------------------------------------------------------------------------

def bandwidth(plan: Plan, r: Recorder) -> None:
    rate = m.copy_bandwidth(plan.device, (1 << 30) if plan.gpu else (1 << 24)) / 1e9
    r.add("copy bandwidth GB/s", rate, plan.device, key="gb_s")


def decode(plan: Plan, r: Recorder, label: str) -> None:
    """Decode tok/s at batch 1 and 8, and the share of the copy-bandwidth roofline (weights read once a step)."""
    from runtime.engine import LLM

    if label == "int4":
        _, seconds = build(plan.work / "big-ckpt", plan.engine("big-int4"), plan.device, plan.dtype, "int4_rtn",
                           8, plan.seq_len)
        r.add("build int4 s", seconds)
    engine = plan.engine(f"big-{label}")
    weights = sum(f.stat().st_size for f in engine.glob("*.onnx.data"))
    gb_s = r.report.value("bandwidth", "gb_s")
    roofline = gb_s * 1e9 / weights if gb_s else None  # steps/s when each step reads every weight once
    llm = LLM(engine, device=plan.device, max_batch_size=8)
    try:
        for batch in (1, 8):
            tok_s = m.decode_tok_s(llm, batch, plan.new_tokens, plan.repeats)
            r.add(f"{label} batch {batch} tok/s", tok_s, f"{tok_s / batch / roofline:.0%} of the roofline ({roofline:.0f} "
                  "steps/s)" if roofline else "no bandwidth measured", key=f"batch{batch}")
    finally:
        llm.close()


def step_overlap(plan: Plan, r: Recorder) -> None:
    """Issue 28: the executor's batch-1 step against the raw (captured-graph) runner step; target >= 90%."""
    figures = m.step_overhead(plan.engine("big-fp"), plan.device, plan.new_tokens, plan.repeats)
    for mode in ("off", "on", "ahead"):
        ours, raw = figures[f"executor_ms_{mode}"], figures[f"runner_ms_{mode}"]
        r.add(f"batch 1 executor step us, overlap {mode}", ours * 1e3,
              f"raw step {raw * 1e3:.1f} us: {raw / ours:.0%} of its rate (target >= 90%)", key=f"executor_{mode}")
    r.verdict("the three overlap modes' tokens", figures["same_tokens"], "same" if figures["same_tokens"] else "DIFFER")


def concurrency(plan: Plan, r: Recorder) -> None:
    """Mixed-length concurrent requests against one stream, prompt buckets off (every prompt length a new call
    shape) and on (the runtime's CUDA default: a few shapes, warmed at load)."""
    from runtime.engine import LLM

    for buckets in (False, True):
        start = time.perf_counter()
        llm = LLM(plan.engine("big-fp"), device=plan.device, prompt_buckets=buckets)
        load = time.perf_counter() - start
        try:
            rate, single, ttft = m.concurrency(llm, plan.requests, plan.new_tokens, plan.longest)
        finally:
            llm.close()
        label, key = ("prompt buckets on", "_buckets") if buckets else ("prompt buckets off", "")
        r.add(f"{plan.requests} concurrent tok/s, {label}", rate,
              f"{rate / single:.1f}x one stream ({single:.1f}); load {load:.1f} s", key=f"rate{key}")
        r.add(f"TTFT p50 ms, {label}", ttft * 1e3, key=f"ttft_ms{key}")


def prefill(plan: Plan, r: Recorder) -> None:
    """Batch-1 prefill at growing prompt lengths: the first call of each shape and the steady cost (tok/s)."""
    from runtime.engine import LLM

    llm = LLM(plan.engine("big-fp"), device=plan.device, prompt_buckets=False)
    try:
        rows = m.prefill_seconds(llm, sorted({16, plan.longest // 4, plan.longest}), plan.repeats)
    finally:
        llm.close()
    for n, first, steady in rows:
        r.add(f"prefill {n} tokens ms, steady", steady * 1e3, f"{n / steady:.0f} tok/s; first call {first * 1e3:.1f} ms")


def first_call(plan: Plan, r: Recorder) -> None:
    """Where a call shape's first run goes (tools/gpu/first_call.py): per variant, each in a process of its own,
    the first run of a new prompt length against the steady one; the ORT profile's per-op split in the log."""
    from tools.gpu import first_call as fc

    lengths = sorted({16, plan.longest // 4, plan.longest})
    for result in fc.run_variants(plan.engine("big-fp"), plan.device, lengths, list(fc.VARIANTS)):
        if "error" in result:
            r.verdict(f"first call, {result['variant']}", False, result["error"][-200:])
        for row in result.get("rows", []):
            r.add(f"first call {row['length']} tokens ms, {result['variant']}", row["first_ms"],
                  f"bind {row['bind_ms']:.1f}, steady {row['steady_ms']:.2f}, other row {row['other_row_ms']:.1f}, "
                  f"one longer {row['one_longer_ms']:.1f} ms; load {result['load_s']:.1f} s",
                  key=f"{result['variant']}_{row['length']}")
        if "profile" in result and "first" in result["profile"]:
            first, second = result["profile"]["first"], result["profile"]["second"]
            r.add(f"profiled first run {result['profile']['length']} tokens ms", first["run_ms"],
                  f"nodes {first['nodes_ms']:.1f} ms; second run {second['run_ms']:.2f} ms "
                  f"(nodes {second['nodes_ms']:.2f})", key="profile")


def paged_capacity(plan: Plan, r: Recorder) -> None:
    """Issue 29: sequences running at once, paged vs GQA, on the KV memory of 8 GQA rows: 32 mixed prompts, a
    quarter sharing a 32-token prefix; target 2x."""
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 200, 32).tolist()
    prompts = [(shared if i % 4 == 0 else []) + rng.integers(3, 200, int(n)).tolist()
               for i, n in enumerate(rng.integers(8, plan.longest + 1, 32))]
    if peaks := _paged_vs_gqa(plan, r, plan.work / "big-ckpt", "big", prompts, 8, trusted=True):
        r.add("most sequences at once on 8 GQA rows' KV: paged", float(peaks[1]),
              f"GQA {peaks[0]}: {peaks[1] / max(peaks[0], 1):.1f}x (target 2x)")


def peers(plan: Plan, r: Recorder) -> None:
    for batch in (1, 8):
        rate = m.transformers_tok_s(plan.work / "big-ckpt", plan.device, batch, plan.new_tokens, plan.repeats)
        ours = r.report.value("decode-fp", f"batch{batch}")
        r.add(f"transformers eager batch {batch} tok/s", rate, f"ours {ours / rate:.2f}x" if ours else "")


@dataclass(frozen=True)
class Step:
    """A step: its cap (seconds; past it the step is killed), its GPU estimate (seconds: what it took on a lent
    H100 on 2026-11-26, rounded up; the dry run's budget) and what it runs."""

    cap_s: int
    estimate_s: int
    run: Callable[[Plan, Recorder], None]


STEPS: dict[str, Step] = {  # the run order: correctness first, then speed; a new check is a function and a line
    "provider": Step(60, 8, provider),
    "trained-build": Step(120, 15, trained_build),
    "trained-greedy": Step(120, 10, trained_greedy),
    "trained-int4": Step(120, 5, trained_int4),
    "inflight": Step(120, 5, inflight),
    "ahead": Step(90, 5, ahead),
    "paged": Step(120, 5, paged),
    "tp2": Step(150, 15, tp2),
    "pp-cuda": Step(150, 30, pp_cuda),
    "big-build": Step(240, 50, big_build),
    "big-greedy": Step(150, 15, big_greedy),
    "bandwidth": Step(60, 5, bandwidth),
    "decode-fp": Step(120, 10, lambda p, r: decode(p, r, "fp")),
    "decode-int4": Step(180, 20, lambda p, r: decode(p, r, "int4")),
    "step-overlap": Step(150, 15, step_overlap),
    "concurrency": Step(150, 25, concurrency),
    "prefill": Step(90, 5, prefill),
    "first-call": Step(200, 60, first_call),
    "paged-capacity": Step(240, 50, paged_capacity),
    "peers": Step(150, 10, peers),
    # issue 46: the CUDA weight-only kernels, then the headline recipe at the 7B shape (tools/gpu/headline.py);
    # estimates are guesses until a lent GPU runs them (16 cores there; the CPU figures in docs/GPU.md)
    "weight-kernels": Step(240, 60, h.weight_kernels),
    "headline-ckpt": Step(300, 120, h.headline_ckpt),
    "headline-build": Step(600, 240, h.headline_build),
    "headline-tp": Step(300, 90, h.headline_tp),
    "headline-parity": Step(300, 120, h.headline_parity),
    "headline-decode": Step(480, 240, h.headline_decode),
    "headline-serve": Step(300, 150, h.headline_serve),
    "smollm2-cuda": Step(300, 90, h.smollm2_cuda),
}
# a step of these with no failure: passed
CORRECTNESS = tuple(list(STEPS)[:list(STEPS).index("big-greedy") + 1]) + ("headline-tp", "headline-parity",
                                                                          "smollm2-cuda")
PLANS = {  # what a run without --step runs: the visits so far (one call), or issue 46's headline (two calls)
    "default": tuple(list(STEPS)[:list(STEPS).index("peers") + 1]),
    "headline": ("provider", "bandwidth") + tuple(list(STEPS)[list(STEPS).index("weight-kernels"):]),
}


# ---- the worker and its watcher ----------------------------------------------------------------------------

def run_steps(plan: Plan, out: Path, names: list[str], deadline: float) -> None:
    """Run the steps `names` in order in this process until the deadline (epoch seconds)."""
    for name in names:
        if time.time() >= deadline:
            return
        print(f"== {name}", flush=True)
        recorder = Recorder(Report(out), name)
        try:
            STEPS[name].run(plan, recorder)
            status = recorder.result["status"]
            recorder.finish("passed" if status == "running" and name in CORRECTNESS else
                            "measured" if status == "running" else status)
        except Exception as error:  # noqa: BLE001 (a failure is this step's result; the next steps still run)
            traceback.print_exc()  # the whole story goes to check.log
            recorder.add(f"{name} failed", type(error).__name__, str(error)[:400])
            recorder.finish("FAILED")
        print(f"== {name}: {recorder.result['status']} in {recorder.result['seconds']:.1f} s", flush=True)
        if name == "provider" and recorder.result["status"] == "FAILED":
            return  # nothing else can run on this device


def watch(plan: Plan, out: Path, names: list[str], deadline_s: float, log) -> dict:
    """Run the steps `names` in a child process, restarting it after a step that died or ran past its cap; at
    the deadline kill what runs. Returns the report's steps."""
    deadline, reason = time.time() + deadline_s, "the deadline came first"
    todo = list(names)
    while todo and time.time() < deadline:
        child = subprocess.Popen([sys.executable, "-m", "tools.gpu.check", "--out", str(out), "--device", plan.device,
                                  "--work", str(plan.work), "--worker", ",".join(todo), "--worker-deadline", str(deadline)]
                                 + (["--quick"] if plan.quick else []), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                 env={**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"})
        pump = threading.Thread(target=_pump, args=(child.stdout, log), daemon=True)
        pump.start()
        why = _wait(child, out, deadline)
        pump.join(5)
        report = Report(out)
        running = [n for n, s in report.steps.items() if s["status"] == "running"]
        if not running:  # every step ran, the deadline came, the provider failed or the worker could not start
            reason = reason if time.time() >= deadline else "the provider step failed" if child.returncode == 0 \
                else f"the worker died before a step began (exit code {child.returncode}): see check.log"
            break
        name = running[0]  # the child died or was killed inside this step
        _close(report, name, "TIMEOUT" if why else "FAILED",
               why or f"its process died (exit code {child.returncode}): see check.log")
        todo = todo[todo.index(name) + 1:] if name != "provider" else []
    report = Report(out)
    for name in STEPS:
        if name not in report.steps:
            report.steps[name] = {"status": "not run", "rows": [], "values": {}, "seconds": 0.0,
                                  "note": reason if name in names else "not asked"}
    report.save()
    return report.steps


def _wait(child: subprocess.Popen, out: Path, deadline: float) -> str:
    """Wait for the child; kill it (its whole process group) at the deadline or when its running step passes
    its cap. Returns why it was killed ("" when it ended by itself)."""
    while child.poll() is None:
        time.sleep(0.2)
        why = "the check's deadline came" if time.time() >= deadline else ""
        try:
            steps = json.loads((out / "check.json").read_text())["steps"]
        except (OSError, ValueError):
            steps = {}
        for name, step in steps.items():
            if step["status"] == "running" and time.time() - step["started"] > STEPS[name].cap_s:
                why = f"past its {STEPS[name].cap_s} s cap"
        if why:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return why
    return ""


def _close(report: Report, name: str, status: str, why: str) -> None:
    step = report.steps[name]
    step["rows"].append([name, status, why])
    step["status"], step["seconds"] = status, time.time() - step["started"]
    report.save()


def _pump(stream, log) -> None:
    """Copy the child's output to this process's stdout and the log file, line by line."""
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        sys.stdout.write(text)
        sys.stdout.flush()
        log.write(text)
        log.flush()


def table(steps: dict) -> str:
    """Every step's rows, in run order, as aligned plain text (a step with no rows: its status)."""
    rows = [["step", "measurement", "figure", "note"]]
    for name in STEPS:
        step = steps.get(name, {"status": "not run", "rows": []})
        rows.append([name, f"[{step['status']}] {step.get('seconds', 0):.0f} s", "", step.get("note", "")])
        rows += [["", what, figure, note] for what, figure, note in step["rows"]]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3] for row in rows)


@click.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Results: check.json, check.log, table.txt (on the lent machine: $OUT).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--quick", is_flag=True, help="Sizes that fit the deadline (on CPU: small shapes, seconds).")
@click.option("--deadline-s", type=float, default=DEADLINE_S, show_default=True,
              help="After this many seconds no step starts, what runs is killed, the table is printed; exit 0.")
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/gpu-check-work"),
              show_default=True, help="Checkpoints and engines (reused by a rerun on the same machine).")
@click.option("--dry-run", is_flag=True, help="Print the planned device calls, their bytes and the time budget; "
              "write .gpu/COMMANDS.txt.")
@click.option("--plan", "plan_name", type=click.Choice(list(PLANS)), default="default", show_default=True,
              help="The steps a run without --step runs: the checks of the earlier visits, or issue 46's headline.")
@click.option("--step", "only", multiple=True, type=click.Choice(list(STEPS)),
              help="Run only these steps (in the check's order), e.g. after a fix on the same warm machine.")
@click.option("--worker", default=None, hidden=True)
@click.option("--worker-deadline", type=float, default=None, hidden=True)
def main(out: Path | None, device: str, quick: bool, deadline_s: float, work: Path, dry_run: bool,
         plan_name: str, only: tuple[str, ...], worker: str | None, worker_deadline: float | None) -> None:
    """Correctness, then speed, of the CUDA path in one call under a deadline; exits 0 with the table."""
    plan = Plan(device, quick, work)
    if dry_run:
        from tools.gpu.setup import plan as plan_calls

        click.echo(plan_calls(ROOT / ".gpu", deadline_s, {n: STEPS[n].estimate_s for n in PLANS[plan_name]}))
        return
    if out is None:
        raise click.UsageError("give --out (the results folder; on the lent machine $OUT)")
    if worker:
        return run_steps(plan, out, worker.split(","), worker_deadline)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("check.json", "check.log", "table.txt"):
        (out / stale).unlink(missing_ok=True)
    report = Report(out)
    report.data["settings"] = {"device": device, "quick": quick, "deadline_s": deadline_s, "started": time.time()}
    report.save()
    with open(out / "check.log", "a") as log:
        steps = watch(plan, out, [n for n in STEPS if n in only or (not only and n in PLANS[plan_name])], deadline_s, log)
    text = table(steps)
    (out / "table.txt").write_text(text + "\n")
    click.echo(text)


if __name__ == "__main__":
    main()
