"""What weight quantization costs on a trained model: perplexity, top-1 agreement and KL divergence
against the float32 engine, on held-out text the model never saw.

    python -m tools.accuracy [--checkpoint checkpoints/trained/target] [--modes float32,int8,int4_rtn,int4_awq]
        (a mode may carry +in_order: int4_gptq+in_order, GPTQ without act-order, +kv_int8: float32+kv_int8,
        an int8 KV cache, or +self_calibration: calibrated on text the model writes itself)
        [--group-size 32] [--max-tokens 70000] [--window 256] [--out bench_results/accuracy/ACCURACY.md | --write-docs]
        [--set quantization.exclude=[layers.*.qkv] ...]   (recipe overrides for every quantized engine)

One engine per mode is built from the checkpoint (verification off, limits just big enough). The text
is the held-out stdlib files of tools/checkpoints/train_tiny_model.py, each preceded by the EOS token (as in
training), concatenated and cut into non-overlapping windows of `--window` input tokens; each
position predicts the next token of the stream, so a window scores `--window` targets. Every engine
and transformers' own float32 model run the same windows, batch by batch, side by side. Writes a
Markdown report and, next to it, the same numbers as JSON. "vs float32" comes with a 95% interval from the
windows' paired loss differences (the spread of per-window changes, windows taken as independent)."""
from __future__ import annotations

import json
import platform
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import click
import numpy as np

from builder.quant import SCHEMES
from tools.corpus import read_source, recorded_heldout_files, stdlib_relative

REFERENCE = "float32"  # the unquantized engine: what agreement and KL compare with
MODES = (REFERENCE, *SCHEMES)
VARIANTS = {"act_order": "quantization.act_order=true",  # mode+variant, e.g. int4_gptq+act_order (the default)
            "in_order": "quantization.act_order=false",  # int4_gptq+in_order: GPTQ's columns left to right
            "kv_int8": "kv_cache.dtype=int8",  # float32+kv_int8: an int8 KV cache (static calibrated scales)
            "self_calibration": "quantization.calibration=self"}  # calibrated on text the model writes itself
BATCH = 8  # windows per engine call


@dataclass
class Stats:
    """Running sums over scored positions for one model."""

    nll: float = 0.0        # sum of -log p(target)
    agree: int = 0          # argmax equal to the float32 engine's
    kl: float = 0.0         # sum of KL(p_float32 || p_model), nats
    tokens: int = 0
    window_nll: list[float] = field(default_factory=list)  # per window, for the paired interval
    window_agree: list[int] = field(default_factory=list)  # per window, for the paired top-1 difference

    def add(self, logprobs: np.ndarray, targets: np.ndarray, reference: np.ndarray, windows: int = 1) -> None:
        """logprobs, reference [n, vocab] float64 log-softmax; targets [n], `windows` windows of n / windows."""
        nll = -logprobs[np.arange(len(targets)), targets]
        self.window_nll += nll.reshape(windows, -1).sum(-1).tolist()
        self.nll += float(nll.sum())
        agree = (logprobs.argmax(-1) == reference.argmax(-1)).reshape(windows, -1).sum(-1)
        self.window_agree += agree.tolist()
        self.agree += int(agree.sum())
        self.kl += float((np.exp(reference) * (reference - logprobs)).sum())
        self.tokens += len(targets)

    def summary(self, reference: Stats) -> dict:
        return {"perplexity": float(np.exp(self.nll / self.tokens)), "loss": self.nll / self.tokens,
                "top1_agreement": self.agree / self.tokens, "kl_per_token": self.kl / self.tokens,
                "vs_reference_95": self.interval(reference)}

    def top1_difference(self, other: Stats) -> tuple[float, float]:
        """(this model's top-1 agreement minus `other`'s on the same positions, its standard error from the windows'
        paired differences: windows taken as independent, positions within one not)."""
        diff = np.array(self.window_agree) - np.array(other.window_agree)
        se = float(diff.std(ddof=1) * np.sqrt(len(diff)) / self.tokens) if len(diff) > 1 else 0.0
        return (self.agree - other.agree) / self.tokens, se

    def interval(self, reference: Stats) -> float:
        """Half-width of the 95% interval of the relative perplexity change from `reference`: 1.96 standard
        errors of the mean loss difference, from the windows' paired differences."""
        diff = np.array(self.window_nll) - np.array(reference.window_nll)
        return float(1.96 * diff.std(ddof=1) * np.sqrt(len(diff)) / self.tokens) if len(diff) > 1 else 0.0


@dataclass
class Engine:
    mode: str
    path: Path
    build_s: float
    size_bytes: int
    quantized: int = 0       # linears in MatMulNBits
    float_linears: list[str] = field(default_factory=list)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def heldout_stream(checkpoint: Path, max_tokens: int, window: int) -> tuple[np.ndarray, dict]:
    """Windows [count, window + 1] of the held-out token stream (inputs [:, :-1], targets [:, 1:]),
    and a description of the text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    eos = json.loads((checkpoint / "config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    files, ids = recorded_heldout_files(), []
    for path in files:
        ids.append(eos)
        ids.extend(tokenizer.encode(read_source(path), add_special_tokens=False).ids)
    stream = np.array(ids, dtype=np.int64)
    count = min(max_tokens // window, (len(stream) - 1) // window)
    if count < 1:
        raise click.UsageError(f"--max-tokens {max_tokens} / --window {window}: no whole window "
                               f"(the held-out stream has {len(stream)} tokens)")
    windows = np.stack([stream[i * window:i * window + window + 1] for i in range(count)])
    text = {"files": [stdlib_relative(p) for p in files], "stream_tokens": len(stream), "eos_token_id": eos}
    return windows, text


def build(checkpoint: Path, mode: str, group_size: int, out: Path, window: int,
          accuracy_level: int | None, lm_head: str = "float", extra: tuple[str, ...] = ()) -> Engine:
    """Build one engine for `mode`, timed (imports already warm)."""
    from builder.build import build_engine
    from builder.recipe import load_recipe

    overrides = [f"limits.max_seq_len={window}", f"limits.max_batch_size={BATCH}", "verify.enabled=off"]
    scheme, *variants = mode.split("+")
    overrides += [VARIANTS[v] for v in variants]
    if scheme != REFERENCE:
        overrides.append(f"quantization.mode={scheme}")
        if SCHEMES[scheme].bits == 4:  # --group-size is int4's; int8 keeps its default block (the report says so)
            overrides.append(f"quantization.group_size={group_size}")
        if accuracy_level is not None:
            overrides.append(f"quantization.accuracy_level={accuracy_level}")
        overrides.append(f"quantization.lm_head={'none' if lm_head == 'float' else lm_head}")  # same | int8
        overrides += extra
    recipe = load_recipe(base={"model": str(checkpoint)}, overrides=overrides)
    start = time.perf_counter()
    path = build_engine(recipe, out / mode, log=lambda _: None)
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    from runtime.manifest.load import read_manifest

    record = read_manifest(path, check_files=False).quantization.record
    return Engine(mode, path, seconds, size, len(record.get("quantized", {})), sorted(record.get("skipped", {})))


def engine_logprobs(engine: Path) -> Callable[[np.ndarray], np.ndarray]:
    """A function: input ids [rows, window] -> log-probs [rows * window, vocab] from one engine call."""
    from runtime.engine import LLM

    llm = LLM(engine, max_batch_size=BATCH)

    def run(ids: np.ndarray) -> np.ndarray:
        rows, seq = ids.shape
        logits = llm.runner.run(0, ids, np.full(rows, seq - 1), seq, np.arange(rows * seq))
        return log_softmax(logits)
    return run


def transformers_logprobs(checkpoint: Path) -> Callable[[np.ndarray], np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, trust_remote_code=False).eval()

    def run(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.from_numpy(ids)).logits
        return log_softmax(logits.reshape(-1, logits.shape[-1]).numpy())
    return run


def batches(windows: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for first in range(0, len(windows), BATCH):
        chunk = windows[first:first + BATCH]
        yield chunk[:, :-1], chunk[:, 1:].reshape(-1)


def evaluate(checkpoint: str | Path, modes: list[str], group_size: int = 32, max_tokens: int = 70000,
             window: int = 256, accuracy_level: int | None = None, log: Callable[[str], None] = print,
             lm_head: str = "float", extra: tuple[str, ...] = ()) -> dict:
    """Build an engine per mode in a temporary directory and score them all on the held-out windows.
    Returns the report: settings, text, versions, and per model its metrics, size and build time."""
    checkpoint = Path(checkpoint)
    modes = [REFERENCE] + [m for m in modes if m != REFERENCE]
    windows, text = heldout_stream(checkpoint, max_tokens, window)
    log(f"held-out text: {len(windows)} windows of {window} tokens from {len(text['files'])} files")
    models = {"transformers": transformers_logprobs(checkpoint)}  # also warms the torch/transformers imports
    with tempfile.TemporaryDirectory(prefix="accuracy-") as tmp:
        engines = {}
        for mode in modes:
            engines[mode] = build(checkpoint, mode, group_size, Path(tmp), window, accuracy_level, lm_head, extra)
            log(f"built {mode} in {engines[mode].build_s:.1f} s, {engines[mode].size_bytes / 1e6:.2f} MB")
            models[mode] = engine_logprobs(engines[mode].path)
        stats = {name: Stats() for name in models}
        max_logit_gap = 0.0  # float32 engine vs transformers, in log-prob
        for ids, targets in batches(windows):
            reference = models[REFERENCE](ids)  # [rows * window, vocab]
            for name, run in models.items():  # one model's log-probs at a time: 8 windows are 67 MB
                logprobs = reference if name == REFERENCE else run(ids)
                stats[name].add(logprobs, targets, reference, len(ids))
                if name == "transformers":
                    max_logit_gap = max(max_logit_gap, float(np.abs(reference - logprobs).max()))
    results = {name: s.summary(stats[REFERENCE]) for name, s in stats.items()}
    pairs = compare_pairs(stats, [m for m in modes if m != REFERENCE])
    for mode, engine in engines.items():
        results[mode].update(size_bytes=engine.size_bytes, build_s=engine.build_s,
                             quantized_linears=engine.quantized, float_linears=engine.float_linears)
    results["transformers"]["max_abs_logprob_diff_vs_float32_engine"] = max_logit_gap
    return {"checkpoint": str(checkpoint), "weights_sha256": weights_sha256(checkpoint), "modes": modes,
            "group_size": group_size, "window": window, "windows": len(windows),
            "scored_tokens": int(windows[:, 1:].size),
            "accuracy_level": accuracy_level, "overrides": list(extra), "float_embedding_bytes": float_embedding_bytes(checkpoint),
            "text": text, "results": results, "pairs": pairs, "versions": versions()}


def compare_pairs(stats: dict[str, Stats], modes: list[str]) -> list[dict]:
    """Each later mode against each earlier one: relative perplexity change and its paired 95% interval."""
    pairs = []
    for i, base in enumerate(modes):
        for model in modes[i + 1:]:
            change = float(np.exp((stats[model].nll - stats[base].nll) / stats[base].tokens) - 1)
            pairs.append({"base": base, "model": model, "perplexity_change": change,
                          "interval_95": stats[model].interval(stats[base])})
    return pairs


def versions() -> dict:
    import onnxruntime
    import torch
    import transformers

    return {"python": platform.python_version(), "numpy": np.__version__, "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__, "transformers": transformers.__version__, "cpu": _cpu_name()}


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []
    return names[0] if names else platform.machine()


def weights_sha256(checkpoint: Path) -> str:
    """Of the checkpoint's safetensors files, in name order: which weights the numbers are for."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(checkpoint.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def float_embedding_bytes(checkpoint: Path) -> int:
    """float32 bytes of the embedding and lm_head, which stay float in every engine here."""
    config = json.loads((checkpoint / "config.json").read_text())
    tables = 1 if config.get("tie_word_embeddings") else 2
    return tables * config["vocab_size"] * config["hidden_size"] * 4


def markdown(report: dict, command: str, date: str) -> str:
    """The docs/ACCURACY.md page for a report."""
    results, ref = report["results"], report["results"][REFERENCE]
    rows = ["| model | perplexity | vs float32 (95%) | top-1 agreement | KL(float32 ‖ model) / token | engine MB | build s |",
            "|---|---|---|---|---|---|---|"]
    for name in ["transformers"] + report["modes"]:
        r = results[name]
        size = f"{r['size_bytes'] / 1e6:.2f}" if "size_bytes" in r else "-"
        built = f"{r['build_s']:.1f}" if "build_s" in r else "-"
        rel = r["perplexity"] / ref["perplexity"] - 1
        rows.append(f"| {name} | {r['perplexity']:.3f} | {rel:+.2%} ± {r['vs_reference_95']:.2%} | {r['top1_agreement']:.4f} | "
                    f"{r['kl_per_token']:.5f} | {size} | {built} |")
    pairs = "".join(f"\n- {p['model']} against {p['base']}: perplexity {p['perplexity_change']:+.2%} ± "
                    f"{p['interval_95']:.2%} (95%, paired by window)" for p in report.get("pairs", []))
    v = report["versions"]
    level = report["accuracy_level"]
    level_text = "4 (the CPU default)" if level is None else str(level)
    float_linears = sorted({name for m in report["modes"] for name in results[m].get("float_linears", [])})
    return f"""# Quantization accuracy

Measured {date} on `{report['checkpoint']}` (safetensors sha256 `{report['weights_sha256'][:16]}…`),
{report['windows']} held-out windows of {report['window']} tokens, {report['scored_tokens']} scored tokens.
Generated by:

```bash
{command}
```

{chr(10).join(rows)}
{pairs}

- **perplexity**: exp of the mean next-token cross-entropy over every scored position. "vs float32" is
  its relative change from the float32 engine, ± the half-width of its 95% interval (1.96 standard errors
  of the windows' paired loss differences).
- **top-1 agreement**: fraction of positions whose most likely next token equals the float32 engine's.
- **KL**: mean over positions of KL(p_float32 ‖ p_model) in nats, the full next-token distributions.
- **engine MB**: the engine directory (ONNX graph, external weights, tokenizer, manifest), 10^6 bytes.
  The embedding and `lm_head` (kept float here unless `--lm-head` says otherwise) stay float32 in every engine:
  {report['float_embedding_bytes'] / 1e6:.2f} MB of every engine here.
- **build s**: wall time of `build_engine` with verification off, imports already warm; int4_awq's
  includes running transformers on the calibration text and the scale search. Timings on the shared
  2-core machine vary several-fold from run to run.
- **transformers**: the checkpoint in transformers, float32, on the same windows: a sanity check of
  the float32 engine (largest |log-prob difference| at any position:
  {results['transformers']['max_abs_logprob_diff_vs_float32_engine']:.2e}).

Text: the {len(report['text']['files'])} held-out files of `tools/checkpoints/train_tiny_model.py` (never trained on),
each preceded by the EOS token (id {report['text']['eos_token_id']}), concatenated
({report['text']['stream_tokens']} tokens) and cut into non-overlapping windows of {report['window']} input
tokens; position i of a window predicts stream token i + 1, so every window scores {report['window']}
targets and starts without context. Quantized engines: group size {report['group_size']} for int4 (int8
uses blocks of {SCHEMES['int8'].group_size}), MatMulNBits accuracy_level {level_text}, which also quantizes activations to int8
on the fly, so the numbers include that error. Linears left float: {', '.join(float_linears) or 'none'}.
Recipe overrides of the quantized engines: {', '.join(report.get('overrides', [])) or 'none'}.
`+kv_int8`: the same engine with an int8 KV cache (`kv_cache.dtype: int8`, static per-channel K and V
scales calibrated on builder/data/calibration.txt, K on the rotation-invariant envelope of each rotary pair);
every window's prefill reads its own K/V back from the int8 cache, so each scored position includes the KV error.

Versions: Python {v['python']}, numpy {v['numpy']}, onnxruntime {v['onnxruntime']}, torch {v['torch']},
transformers {v['transformers']}; {v['cpu']}. The same numbers are in
`{report.get('json_name', 'ACCURACY.json')}`; `tests/builder/test_accuracy.py` checks the bounds on 4096 tokens.
"""


def command_line(options: dict, overrides: tuple[str, ...] = ()) -> str:
    args = ["python", "-m", "tools.accuracy"]
    for key, value in options.items():
        if value is not None:
            args += [f"--{key.replace('_', '-')}", str(value)]
    for override in overrides:
        args += ["--set", override]
    return shlex.join(args)


DOCS_REPORT = "docs/ACCURACY.md"  # tracked: rewritten only when asked (--write-docs)
KEPT = "<!-- Written by hand below this line: tools.accuracy keeps it when it rewrites the report above. -->"


def with_kept_sections(page: str, old: Path) -> str:
    """The generated `page` followed by the hand-written sections of the report it replaces."""
    text = old.read_text() if old.is_file() else ""
    return page + "\n" + KEPT + text.split(KEPT, 1)[1] if KEPT in text else page


@click.command()
@click.option("--checkpoint", default="checkpoints/trained/target", show_default=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--modes", default="float32,int8,int4_rtn,int4_awq", show_default=True,
              help="comma-separated; float32 is always evaluated (the reference)")
@click.option("--group-size", default=32, show_default=True, type=click.Choice(["16", "32", "64", "128"]))
@click.option("--max-tokens", default=70000, show_default=True, type=click.IntRange(min=1),
              help="scored tokens at most; the default takes the whole held-out stream (65024 in 254 windows of "
                   "256): on 20000 the 95% interval of an int4 engine's perplexity change is about ±0.2%, "
                   "as wide as the differences between methods (docs/ACCURACY.md)")
@click.option("--window", default=256, show_default=True, type=click.IntRange(min=2))
@click.option("--accuracy-level", default=None, type=click.IntRange(0, 4),
              help="MatMulNBits accuracy_level of the quantized engines (default: the CPU default, 4)")
@click.option("--lm-head", default="float", show_default=True, type=click.Choice(["float", "same", "int8"]),
              help="the quantized engines' lm_head: float, quantized like the other linears, or int8")
@click.option("--out", default="bench_results/accuracy/ACCURACY.md", show_default=True, type=click.Path(path_type=Path),
              help="Markdown report; the JSON goes next to it with the suffix .json")
@click.option("--write-docs", is_flag=True, help=f"Write the tracked report {DOCS_REPORT} (instead of --out).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="a recipe override for every quantized engine, e.g. quantization.exclude=[layers.*.qkv]")
def main(checkpoint: Path, modes: str, group_size: str, max_tokens: int, window: int,
         accuracy_level: int | None, lm_head: str, out: Path, write_docs: bool, overrides: tuple[str, ...]) -> None:
    """Measure the quantization modes; the report goes to --out (untracked), or with --write-docs to the docs."""
    out = Path(DOCS_REPORT) if write_docs else out
    wanted = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = sorted(m for m in wanted if m.split("+")[0] not in MODES or set(m.split("+")[1:]) - set(VARIANTS))
    if unknown:
        raise click.BadParameter(f"unknown modes {unknown}; choose from {sorted(MODES)}, optionally with "
                                 f"+{' +'.join(VARIANTS)}", param_hint="--modes")
    report = evaluate(checkpoint, wanted, int(group_size), max_tokens, window, accuracy_level, lm_head=lm_head,
                      extra=overrides)
    command = command_line({"checkpoint": checkpoint, "modes": ",".join(wanted), "group_size": group_size,
                            "max_tokens": max_tokens, "window": window, "accuracy_level": accuracy_level,
                            "lm_head": None if lm_head == "float" else lm_head, "out": out}, overrides)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    json_path = out.with_suffix(".json")
    report.update(command=command, date=date, json_name=json_path.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(with_kept_sections(markdown(report, command, date), out))
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(f"wrote {out} and {json_path}")


if __name__ == "__main__":
    main()
