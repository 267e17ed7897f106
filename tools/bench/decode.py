"""Decode throughput, side by side in one run: our engine (float32, int8, int4) vs transformers'
generate and onnxruntime-genai (float32 and its own int4 build, when it is installed) on the same random
Llama-shaped checkpoint, on CPU.

    python -m tools.bench.decode --preset bench150m --batch-sizes 1,8 --runs 5 --write-docs docs/BENCHMARKS.md

Every backend generates exactly `new_tokens` greedy tokens per row (EOS ignored) for the same random
prompts. Decode tokens/s = batch * (new_tokens - 1) / (end of generation - the moment every row has its
first token), so prompt processing (time to first token) is never counted as decode time. The first token
is timestamped inside the run: the engine's own per-sequence first-token clock, a StoppingCriteria in
transformers (called once per generated token), the first `generate_next_token` in onnxruntime-genai.

Every backend lives in its own process (tools/bench/isolated.py), so no two backends' thread pools or
libraries share one; backends still alternate run by run (rotating order, a short pause between them);
each is warmed up once per batch size; the median over runs is reported with min and max. Every engine
variant is built in its own process too, which gives its build time and the builder's peak memory.

More engine variants are extra rows: add (label, recipe overrides) to ENGINE_VARIANTS.
"""
from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import platform
import re
import shlex
import statistics
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import click
import numpy as np

from tools.bench import env, isolated
from tools.bench.docs import replace_section
from tools.bench.measure import Timing, int_list, synthetic_prompts, timed_generate
from tools.bench.moe import parameter_counts
from tools.bench.stats import spread
from tools.checkpoints.make_checkpoint import PRESETS

SECTION = "## Decode throughput: float32 and quantized engines"


def section_title(preset: str) -> str:
    """Dense presets share SECTION; a mixture-of-experts preset has its own section."""
    family = PRESETS[preset].get("family", "llama")
    return f"## Decode throughput: mixture of experts ({preset})" if "moe" in family else SECTION
REFERENCE = "transformers"

# (label, recipe overrides) per engine row; every variant is built from the same checkpoint with the base
# overrides of `engine_recipe` (float32 cpu target, verify off, limits sized to the workload) first.
# Quantized rows quantize lm_head too, as onnxruntime-genai's int4 build does (MatMulNBits, symmetric,
# blocks of 32, accuracy_level 4 on CPU): the same work, so the comparison is like for like.
ENGINE_VARIANTS: list[tuple[str, list[str]]] = [
    ("engine fp32", []),
    ("engine int8", ["quantization.mode=int8", "quantization.exclude=[]"]),
    ("engine int4", ["quantization.mode=int4_rtn", "quantization.group_size=32", "quantization.exclude=[]"]),
]
GENAI_PRECISIONS = ("fp32", "int4")  # onnxruntime-genai builds, labelled "onnxruntime-genai <precision>"

# The issues' targets: (numerator, denominator, minimum ratio, batch sizes it applies to; None = all).
TARGETS: list[tuple[str, str, float, tuple[int, ...] | None]] = [
    ("engine fp32", REFERENCE, 2.5, None),
    ("engine int8", "engine fp32", 1.7, (1,)),
    ("engine int4", "engine fp32", 2.5, (1,)),
    ("engine int4", "onnxruntime-genai int4", 1.3, None),
]


def genai_label(precision: str) -> str:
    return f"onnxruntime-genai {precision}"


@dataclass(frozen=True)
class Workload:
    preset: str = "bench150m"
    batch_sizes: tuple[int, ...] = (1, 8)
    prompt_len: int = 64
    new_tokens: int = 64
    runs: int = 5
    threads: int = 2
    settle_s: float = 0.3  # pause between backends so one's spinning thread pool does not slow the next

    def __post_init__(self) -> None:
        if self.new_tokens < 2:
            raise ValueError("new_tokens must be >= 2: decode starts after the first token")
        if self.runs < 1 or self.prompt_len < 1 or self.threads < 1 or not self.batch_sizes:
            raise ValueError("runs, prompt_len, threads must be >= 1 and batch_sizes non-empty")
        if min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len + self.new_tokens


@dataclass
class Measurement:
    """All timed runs of one backend at one batch size."""

    backend: str
    batch_size: int
    new_tokens: int
    runs: list[Timing] = field(default_factory=list)

    @property
    def decode_tok_s(self) -> list[float]:
        decoded = self.batch_size * (self.new_tokens - 1)
        return [decoded / t.decode_s for t in self.runs]

    def summary(self) -> dict:
        rates = self.decode_tok_s
        return {"backend": self.backend, "batch_size": self.batch_size, "decode_tok_s": spread(rates),
                "ttft_s_median": statistics.median(t.first_token_s for t in self.runs),
                "runs": [asdict(t) | {"decode_tok_s": r} for t, r in zip(self.runs, rates)]}


class Backend(Protocol):
    label: str

    def generate(self, prompts: np.ndarray, new_tokens: int) -> Timing:
        """Greedy-generate exactly `new_tokens` tokens for every row of prompts [batch, prompt_len]."""

    def close(self) -> None: ...


# -- backends -------------------------------------------------------------------------------------
class EngineBackend:
    """Our engine through the runtime's public path (LLM executor), as a user would run it."""

    def __init__(self, label: str, engine_dir: Path, work: Workload):
        from runtime.engine import LLM

        self.label = label
        # the whole batch's prompts are prefilled in the first step; no prefix reuse across runs
        self.llm = LLM(engine_dir, max_batch_size=max(work.batch_sizes), max_seq_len=work.max_seq_len,
                       threads=work.threads, max_tokens_per_step=max(work.batch_sizes) * work.prompt_len,
                       min_prefix_reuse=work.max_seq_len + 1)

    def generate(self, prompts: np.ndarray, new_tokens: int) -> Timing:
        return timed_generate(self.llm, prompts, new_tokens)

    def close(self) -> None:
        self.llm.close()


class TransformersBackend:
    """transformers' generate, float32, greedy, KV cache on, torch threads = workload threads."""

    label = REFERENCE

    def __init__(self, checkpoint: Path, work: Workload):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        torch.set_num_threads(work.threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, trust_remote_code=False).eval()

    def generate(self, prompts: np.ndarray, new_tokens: int) -> Timing:
        from transformers import StoppingCriteria, StoppingCriteriaList

        torch = self.torch
        stamps: list[float] = []

        class FirstToken(StoppingCriteria):  # called once per generated token, after it is appended
            def __call__(self, input_ids, scores, **kwargs):
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        ids = torch.from_numpy(prompts.astype(np.int64))
        config = self.model.generation_config
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      num_beams=1, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      use_cache=True, pad_token_id=config.pad_token_id,
                                      stopping_criteria=StoppingCriteriaList([FirstToken()]))
        end = time.perf_counter()
        _check_lengths(self.label, [out.shape[1] - prompts.shape[1]] * len(prompts), new_tokens)
        return Timing(stamps[0] - start, end - start)

    def close(self) -> None:
        del self.model


class OrtGenaiBackend:
    """onnxruntime-genai's CPU model, built from the same checkpoint by its own builder."""

    def __init__(self, label: str, model_dir: Path, work: Workload):
        import onnxruntime_genai as og

        self.og, self.label = og, label
        config = og.Config(str(model_dir))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": work.threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)

    def generate(self, prompts: np.ndarray, new_tokens: int) -> Timing:
        batch, length = prompts.shape
        params = self.og.GeneratorParams(self.model)
        total = length + new_tokens  # min_length = max_length: EOS cannot end a row early
        params.set_search_options(batch_size=batch, max_length=total, min_length=total, do_sample=False)
        start = time.perf_counter()
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(prompts.astype(np.int32))
        generator.generate_next_token()  # samples from the prompt's logits: the first token
        first = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()  # runs the model on the previous token, then samples
        end = time.perf_counter()
        _check_lengths(self.label, [len(generator.get_sequence(b)) - length for b in range(batch)], new_tokens)
        return Timing(first - start, end - start)

    def close(self) -> None:
        del self.model


class Isolated:
    """A backend constructed and run in its own process (tools/bench/isolated.py)."""

    def __init__(self, label: str, factory, *args):
        self.label = label
        self.worker = isolated.Worker(factory, *args)

    def generate(self, prompts: np.ndarray, new_tokens: int) -> Timing:
        return self.worker.call("generate", prompts, new_tokens)

    def close(self) -> None:
        self.worker.close()


def _check_lengths(label: str, lengths: list[int], wanted: int) -> None:
    if any(n != wanted for n in lengths):
        raise RuntimeError(f"{label}: generated {lengths} tokens per row, wanted {wanted} each")


# -- preparing the models -------------------------------------------------------------------------
def prepare_checkpoint(workdir: Path, preset: str, log=print) -> Path:
    """The preset's random checkpoint under `workdir`, made once and reused while the preset is unchanged."""
    from tools.checkpoints.make_checkpoint import make_checkpoint

    path = workdir / "checkpoints" / preset
    marker = path / "bench_preset.json"
    sizes = PRESETS[preset]
    if marker.is_file() and json.loads(marker.read_text()) == sizes:
        log(f"reusing checkpoint {path}")
        return path
    shutil.rmtree(path, ignore_errors=True)
    log(f"making checkpoint {path} (preset {preset})")
    make_checkpoint(path, **sizes)
    marker.write_text(json.dumps(sizes))  # written last: a half-made checkpoint is never reused
    return path


def engine_recipe(checkpoint: Path, work: Workload, overrides: list[str]):
    from builder.recipe import load_recipe

    base = ["target.backend=onnxruntime", "target.device=cpu", "target.dtype=float32", "verify.enabled=off",
            f"limits.max_batch_size={max(work.batch_sizes)}", f"limits.max_seq_len={work.max_seq_len}"]
    return load_recipe(base={"model": str(checkpoint)}, overrides=base + list(overrides))


def build_variant(checkpoint: Path, workdir: Path, label: str, overrides: list[str], work: Workload,
                  log=print) -> tuple[Path, dict]:
    """Build one engine variant in its own process (always rebuilt: the benchmark measures the builder as it
    is now). Returns the engine dir and {seconds, peak_rss_mb, start_rss_mb, engine_mb}."""
    out = workdir / "engines" / f"{work.preset}-{_slug(label)}"
    log(f"building {label} -> {out}")
    path, stats = isolated.run(_build, checkpoint, out, overrides, work, preload=BUILDER_IMPORTS)
    return Path(path), stats | {"engine_mb": _dir_mb(Path(path))}


BUILDER_IMPORTS = ("torch", "transformers", "onnx", "builder.build")


def _build(checkpoint: Path, out: Path, overrides: list[str], work: Workload) -> str:
    from builder.build import build_engine

    return str(build_engine(engine_recipe(checkpoint, work, overrides), out, log=lambda m: None))


def build_ort_genai(checkpoint: Path, workdir: Path, threads: int, precision: str = "fp32",
                    log=print) -> tuple[Path | None, dict | None, str | None]:
    """Build (or reuse) an onnxruntime-genai model of `precision`; returns (dir, build stats, None) or
    (None, None, why the column is skipped). Stats are those of the build that made the dir."""
    try:
        og = importlib.import_module("onnxruntime_genai")
    except ImportError as err:
        return None, None, f"onnxruntime-genai is not installed ({err}); its columns are skipped (pip install onnxruntime-genai)"
    out = workdir / "ort_genai" / f"{checkpoint.name}-{precision}"
    stamp = {"config": (checkpoint / "config.json").read_text(), "version": og.__version__}
    marker = out / "bench_source.json"
    if marker.is_file() and json.loads(marker.read_text()).get("source") == stamp:
        log(f"reusing onnxruntime-genai {precision} model {out}")
        return out, json.loads(marker.read_text())["build"], None
    shutil.rmtree(out, ignore_errors=True)
    log(f"building onnxruntime-genai {precision} model -> {out}")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
           "-p", precision, "-e", "cpu", "-c", str(workdir / "ort_genai" / "cache")]
    (code, output, child_peak), stats = isolated.run(_run_command, cmd, {"OMP_NUM_THREADS": str(threads)})
    if code != 0 or not (out / "genai_config.json").is_file():
        tail = output.strip().splitlines()[-1:] or ["no output"]
        return None, None, f"onnxruntime-genai {precision} builder failed ({tail[0]}); its column is skipped"
    build = {"seconds": stats["seconds"], "peak_rss_mb": child_peak, "start_rss_mb": None, "engine_mb": _dir_mb(out)}
    marker.write_text(json.dumps({"source": stamp, "build": build}))
    return out, build, None


def _run_command(cmd: list[str], extra_env: dict) -> tuple[int, str, float]:
    """Run cmd; returns its exit code, its output and its peak RSS in MB (the only child of this process)."""
    import resource

    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | extra_env)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return proc.returncode, proc.stderr or proc.stdout, peak


def _dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# -- measuring ------------------------------------------------------------------------------------
def measure(backends: list[Backend], work: Workload, vocab_size: int, log=print) -> list[Measurement]:
    """Per batch size: one warm-up per backend, then `runs` rounds in rotating backend order, each round
    on fresh random prompts shared by all backends."""
    results: list[Measurement] = []
    rng = np.random.default_rng(0)
    for batch in work.batch_sizes:
        rows = {b.label: Measurement(b.label, batch, work.new_tokens) for b in backends}
        warm = synthetic_prompts(rng, batch, work.prompt_len, vocab_size)
        for backend in backends:
            backend.generate(warm, work.new_tokens)
            time.sleep(work.settle_s)
        for run in range(work.runs):
            prompts = synthetic_prompts(rng, batch, work.prompt_len, vocab_size)
            for backend in backends[run % len(backends):] + backends[:run % len(backends)]:
                timing = backend.generate(prompts, work.new_tokens)
                rows[backend.label].runs.append(timing)
                log(f"batch {batch} run {run + 1}/{work.runs} {backend.label}: "
                    f"{rows[backend.label].decode_tok_s[-1]:.1f} decode tok/s, ttft {timing.first_token_s * 1e3:.0f} ms")
                time.sleep(work.settle_s)
        results.extend(rows.values())
    return results


def run_benchmark(work: Workload, workdir: Path, variants: list[tuple[str, list[str]]] = ENGINE_VARIANTS,
                  ort_genai: tuple[str, ...] = GENAI_PRECISIONS, command: str = "", log=print,
                  peers: tuple = ()) -> dict:
    """Prepare the checkpoint and models, measure every backend, write `<workdir>/decode-<preset>.json`
    and return the report (the same dict). `peers` add other runtimes' rows: each is called as
    peer(checkpoint, workdir, work, log) and returns a PeerSetup (tools/bench/gguf_peer.py: llama.cpp)."""
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = prepare_checkpoint(workdir, work.preset, log)
    builds, engines = {}, []
    for label, overrides in variants:
        path, builds[label] = build_variant(checkpoint, workdir, label, overrides, work, log)
        engines.append((label, path))
    notes: list[str] = []
    genai = []
    for precision in ort_genai:
        path, stats, note = build_ort_genai(checkpoint, workdir, work.threads, precision, log)
        if note:
            log(f"note: {note}")
            notes.append(note)
        else:
            genai.append((genai_label(precision), path))
            builds[genai_label(precision)] = stats
    setups = [peer(checkpoint, workdir, work, log) for peer in peers]
    for setup in setups:
        builds.update(setup.builds)
        notes.extend(setup.notes)
    machine_before = machine_info()
    backends: list[Backend] = []
    try:
        for label, path in engines:
            backends.append(Isolated(label, EngineBackend, label, path, work))
        backends.append(Isolated(REFERENCE, TransformersBackend, checkpoint, work))
        for label, path in genai:
            backends.append(Isolated(label, OrtGenaiBackend, label, path, work))
        for setup in setups:
            backends.extend(Isolated(label, factory, *args) for label, factory, args in setup.backends)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        measurements = measure(backends, work, vocab, log)
    finally:
        for backend in backends:
            backend.close()
    report = {
        "command": command, "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_before | {"loadavg_after": env.load_average()},
        "versions": library_versions(ort_genai=bool(genai)) | {k: v for s in setups for k, v in s.versions.items()},
        "workload": asdict(work), "checkpoint": str(checkpoint),
        "model_mb": _dir_mb(checkpoint), "parameters": parameter_counts(checkpoint),
        "engines": [{"label": label, "overrides": overrides} for label, overrides in variants],
        "backends": [b.label for b in backends], "builds": builds, "notes": notes,
        "method": "decode tok/s = batch * (new_tokens - 1) / (generation end - time every row has its first token)",
        "results": [m.summary() for m in measurements],
    }
    report["ratios"] = ratios(report)
    out = workdir / f"decode-{work.preset}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"raw numbers written to {out}")
    return report


def ratios(report: dict) -> list[dict]:
    """Every target in TARGETS whose two backends were measured: the median decode tok/s ratio per batch
    size it applies to, and whether it is met."""
    med = {(r["backend"], r["batch_size"]): r["decode_tok_s"]["median"] for r in report["results"]}
    out = []
    for num, den, want, sizes in TARGETS:
        for batch in sizes or report["workload"]["batch_sizes"]:
            if (num, batch) in med and (den, batch) in med:
                ratio = med[(num, batch)] / med[(den, batch)]
                out.append({"numerator": num, "denominator": den, "batch_size": batch, "ratio": ratio,
                            "want": want, "met": ratio >= want})
    return out


# -- environment ----------------------------------------------------------------------------------
def machine_info() -> dict:
    vector = env.cpu_vector_flags()
    return {"cpu": env.cpu_model() + (f" ({vector})" if vector else ""), "cores": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_before": env.load_average()}


def library_versions(ort_genai: bool) -> dict[str, str]:
    names = ["onnxruntime", "torch", "transformers", "numpy"] + (["onnxruntime_genai"] if ort_genai else [])
    from builder import __version__

    return env.module_versions(names) | {"builder": __version__}


# -- reporting ------------------------------------------------------------------------------------
def _fmt(x: float) -> str:
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def summary_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """Rows: batch sizes; columns: each backend's median decode tok/s."""
    med = {(r["backend"], r["batch_size"]): r["decode_tok_s"]["median"] for r in report["results"]}
    header = ["batch"] + [f"{b} (tok/s)" for b in report["backends"]]
    rows = [[str(batch)] + [_fmt(med[(b, batch)]) for b in report["backends"]]
            for batch in report["workload"]["batch_sizes"]]
    return header, rows


def target_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["ratio (median decode tok/s)", "batch", "measured", "target", "verdict"]
    rows = [[f"{t['numerator']} / {t['denominator']}", str(t["batch_size"]), f"{t['ratio']:.2f}x",
             f">= {t['want']}x", "meets" if t["met"] else "MISSES"] for t in report["ratios"]]
    return header, rows


def build_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["model", "size on disk (MB)", "build (s)", "builder peak RSS (MB)", "RSS before the build (MB)"]
    rows = [[label, f"{b['engine_mb']:.0f}", f"{b['seconds']:.1f}", f"{b['peak_rss_mb']:.0f}",
             "-" if b["start_rss_mb"] is None else f"{b['start_rss_mb']:.0f}"]
            for label, b in report["builds"].items()]
    return header, rows


def detail_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["backend", "batch", "decode tok/s median", "min", "max", "TTFT median (ms)", "runs"]
    rows = [[r["backend"], str(r["batch_size"]), _fmt(r["decode_tok_s"]["median"]), _fmt(r["decode_tok_s"]["min"]),
             _fmt(r["decode_tok_s"]["max"]), f"{r['ttft_s_median'] * 1e3:.0f}", str(len(r["runs"]))]
            for r in report["results"]]
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def markdown_section(report: dict) -> str:
    """The docs section for this report, starting with SECTION."""
    w, m, v = report["workload"], report["machine"], report["versions"]
    engines = "; ".join(f"`{e['label']}`: " + (" ".join(f"`--set {o}`" for o in e["overrides"]) or "no extra overrides")
                        for e in report["engines"])
    params = report.get("parameters", {})
    parts = [
        section_title(w["preset"]), "",
        f"Random-weight {PRESETS[w['preset']].get('family', 'llama')}-shaped checkpoint, preset `{w['preset']}` "
        f"(`tools/checkpoints/make_checkpoint.py`, {params.get('total', 0) / 1e9:.2f}B parameters, "
        f"{params.get('active_per_token', 0) / 1e9:.3f}B read per decoded token: decode bytes per token ~ that x "
        f"4 (float32), ~1 (int8), ~0.5 (int4) plus scales; "
        f"{report['model_mb']:.0f} MB of float32 safetensors); prompts of {w['prompt_len']} random tokens, "
        f"{w['new_tokens']} greedy new tokens per row (EOS ignored), {w['threads']} threads for every backend, each "
        f"backend in its own process. Decode tok/s = batch x (new_tokens - 1) / (end of generation - moment every "
        f"row has its first token): prompt processing is excluded. Median of {w['runs']} runs after one warm-up "
        f"each; backends alternate run by run.", "",
        "```bash", report["command"] or "python -m tools.bench.decode", "```", "",
        f"- Date: {report['date']}",
        f"- Machine: {m['cpu']}, {m['cores']} cores ({m['platform']}); load average before "
        f"{m['loadavg_before'][0]:.2f}, after {m['loadavg_after'][0]:.2f}",
        f"- Libraries: Python {m['python']}, " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- Engines: float32 CPU recipe, verify off, limits max_batch_size {max(w['batch_sizes'])} / max_seq_len "
        f"{w['prompt_len'] + w['new_tokens']}; {engines}. onnxruntime-genai models come from its own builder "
        f"(`python -m onnxruntime_genai.models.builder -p <precision> -e cpu`).",
        "", markdown_table(*summary_rows(report)),
        "", markdown_table(*target_rows(report)),
        "", "Builds (each in a fresh process; peak RSS is the builder process's peak resident memory, RSS before "
            "is the same process after importing torch, transformers, onnx and the builder):",
        "", markdown_table(*build_rows(report)),
        "", markdown_table(*detail_rows(report)),
    ]
    if report["notes"]:
        parts += [""] + [f"Note: {n}" for n in report["notes"]]
    return "\n".join(parts) + "\n"


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for title, (header, rows) in (("Decode tokens/s (median)", summary_rows(report)),
                                  ("Targets", target_rows(report)), ("Builds", build_rows(report)),
                                  ("All runs", detail_rows(report))):
        table = Table(title=title)
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for note in report["notes"]:
        console.print(f"note: {note}")


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        return int_list(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="bench150m", show_default=True)
@click.option("--batch-sizes", callback=_int_list, default="1,8", show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench_results/decode"),
              show_default=True)
@click.option("--ort-genai/--no-ort-genai", default=True, show_default=True,
              help="Add onnxruntime-genai fp32 and int4 columns when it is installed.")
@click.option("--write-docs", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=f"Write the results into this markdown file under '{SECTION}'.")
def main(preset: str, batch_sizes: tuple[int, ...], prompt_len: int, new_tokens: int, runs: int, threads: int,
         workdir: Path, ort_genai: bool, write_docs: Path | None) -> None:
    """Decode tokens/s of our engine (float32, int8, int4) vs transformers and onnxruntime-genai on CPU."""
    work = Workload(preset, batch_sizes, prompt_len, new_tokens, runs, threads)
    command = "python -m tools.bench.decode " + shlex.join(sys.argv[1:])
    report = run_benchmark(work, workdir, ENGINE_VARIANTS, GENAI_PRECISIONS if ort_genai else (), command,
                           log=click.echo)
    print_report(report)
    if write_docs is not None:
        replace_section(write_docs, markdown_section(report))
        click.echo(f"wrote {write_docs} ({section_title(preset)[3:]})")


if __name__ == "__main__":
    main()
