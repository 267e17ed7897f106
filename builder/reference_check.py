"""Build-time verification: run the transformers reference on a few seeded token sequences of
different lengths and compare its logits (every position) and greedy picks with the built engine.

An int8 KV cache is checked like quantized activations: max |logit error| within verify.quantized_tolerance
x the largest reference logit and greedy agreement >= verify.min_greedy_agreement.

A GGUF file's engine that rounds at run time is held to the logit error relative to the reference's own spread
instead (relative_errors): its reference is the file's own weights in float, so what remains is the rounding,
which random tokens drive far at a few positions (SmolLM2's Q4_0 file: 1.17 at one of 57, 0.07 typically),
while a wrong weight moves every position. The median over positions is held to verify.quantized_tolerance.

A quantized engine is compared twice: with transformers running the engine's own effective
(dequantized, AWQ-folded) weights, which checks the lowering and the weight layout, and with the
float model, whose greedy agreement measures what quantization costs (see recipe.Verify)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from builder.recipe import Verify
from runtime.manifest.load import Manifest, read_manifest

DTYPE_TOLERANCE = {"float32": 1.0, "float16": 50.0, "bfloat16": 200.0}  # multiplies verify.tolerance


def reference_logits(model_dir: Path, sequences: list[list[int]],
                     weights: dict[str, np.ndarray] | None = None, device: str = "cpu",
                     dtype: str = "float32") -> list[np.ndarray]:
    """transformers' logits [len, vocab] (as float32) for each sequence, one at a time (no padding), on
    `device` in `dtype`; `weights` replaces checkpoint tensors by name (the effective weights of a
    quantized engine)."""
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = _float_model(model_dir).eval()
    with torch.no_grad():
        for name, value in (weights or {}).items():
            model.get_parameter(name).copy_(torch.from_numpy(value))
        model.to(device=device, dtype=getattr(torch, dtype))
        return [model(torch.tensor([s], device=device)).logits[0].float().cpu().numpy() for s in sequences]


def _float_model(model_dir: Path):
    """The checkpoint in transformers, float32; a pre-quantized one with its modules dequantized exactly
    as its format defines (builder/quant/imported.py), since transformers needs the format's own
    package (gptqmodel, autoawq, compressed-tensors) to load it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from builder.gguf.checkpoint import is_staged, load_reference
    from builder.quant.imported import QuantizedCheckpoint, open_checkpoint

    if is_staged(model_dir):  # transformers loads the GGUF file itself (builder/gguf/checkpoint.py)
        return load_reference(model_dir)
    checkpoint = open_checkpoint(model_dir)
    if not isinstance(checkpoint, QuantizedCheckpoint):
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, trust_remote_code=False)
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is listed once, as the embedding
            param.copy_(torch.from_numpy(checkpoint.read(name)))
    return model


def verification_device(manifest: Manifest) -> str:
    """Where the build-time check runs the engine: on its own device when this onnxruntime has it,
    else on the CPU, where a float16 CUDA engine's graph runs as is (GroupQueryAttention,
    SkipSimplifiedLayerNormalization and MatMulNBits have float16 CPU kernels)."""
    import onnxruntime

    device = manifest.target.device
    if device == "cuda" and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return "cpu"
    return device


def engine_logits(engine_dir: Path, sequences: list[list[int]], device: str | None = None,
                  manifest: Manifest | None = None) -> list[np.ndarray]:
    """The engine's logits for every position of each sequence, prefilled as one ragged batch, on
    `device` (default: verification_device). `manifest`: the engine's, when the build has not written it yet; a
    pipeline-parallel engine runs as the runtime runs it, its stages in processes of their own that read
    manifest.json from `engine_dir` (the build writes it before its check)."""
    from runtime.config import LoadConfig
    from runtime.model.model_runner import ModelRunner
    from runtime.parallel.pipeline_runner import PipelineRunner

    manifest = manifest or read_manifest(engine_dir)
    rows, longest = len(sequences), max(len(s) for s in sequences) + 1
    spec = manifest.kv_cache.resized(rows, longest)
    kind = ModelRunner if manifest.pipeline_parallel is None else PipelineRunner
    runner = kind(engine_dir, manifest, spec, LoadConfig(device=device or verification_device(manifest)))
    lens = np.array([len(s) for s in sequences])
    seq = int(lens.max())
    ids = np.zeros((len(sequences), seq), dtype=np.int64)
    for row, s in enumerate(sequences):
        ids[row, :len(s)] = s
    index = np.concatenate([row * seq + np.arange(n) for row, n in enumerate(lens)])
    try:
        logits = runner.run(0, ids, lens - 1, seq, index)
    finally:
        runner.close()  # a pipeline engine's stage processes end here
    return np.split(logits, np.cumsum(lens)[:-1])


def compare(ours: list[np.ndarray], theirs: list[np.ndarray]) -> tuple[float, float]:
    """(max |logit error|, greedy agreement) over every position."""
    error = max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs))
    agree = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(ours, theirs)])))
    return error, agree


def relative_errors(ours: list[np.ndarray], theirs: list[np.ndarray]) -> np.ndarray:
    """Per position: the RMS of the logit error over the vocabulary / the standard deviation of the reference's
    logits there (their spread). Scale-free: one bar serves a trained model's peaked logits and a random model's
    flat ones; ~1.4 for an engine unrelated to its reference."""
    o, t = np.concatenate(ours).astype(np.float64), np.concatenate(theirs).astype(np.float64)  # [positions, vocab]
    return np.sqrt(((o - t) ** 2).mean(-1)) / np.maximum(t.std(-1), 1e-12)


def check_engine(engine_dir: Path, model_dir: Path, options: Verify, log: Callable[[str], None] = print,
                 weights: dict[str, np.ndarray] | None = None, manifest: Manifest | None = None) -> dict:
    """Compare engine and reference; returns the report recorded in manifest.json. `weights`: the
    effective weights of a quantized engine (builder/quant/reference.py); `manifest`: the engine's, when the
    build has not written it yet."""
    manifest = manifest or read_manifest(engine_dir, check_files=False)
    vocab = manifest.vocab_size
    rng = np.random.default_rng(0)
    lengths = [max(2, options.seq_len - 5 * i) for i in range(options.num_sequences)]
    sequences = [rng.integers(0, vocab, n).tolist() for n in lengths]
    device = verification_device(manifest)
    on_gpu = dict(device="cuda", dtype=manifest.target.dtype) if device == "cuda" else {}
    ours = engine_logits(engine_dir, sequences, device, manifest)
    theirs = reference_logits(model_dir, sequences, weights, **on_gpu)
    error, agree = compare(ours, theirs)
    dtype, quant = manifest.target.dtype, manifest.quantization
    int8_kv = manifest.kv_cache.storage is not None
    rounded = " and ".join(([f"int8 activations (accuracy_level {quant.accuracy_level})"]
                            if quant.mode != "none" and quant.accuracy_level >= 2 else []) +
                           (["int8 KV"] if int8_kv else []))  # what the engine rounds at run time
    bar = _bar(ours, theirs, error, options, dtype, rounded, _is_gguf(model_dir))
    exact = dtype == "float32" and quant.mode == "none" and not int8_kv
    passed = (bar.measured <= bar.tolerance and (agree == 1.0 or not exact)
              and (agree >= options.min_greedy_agreement or not int8_kv))
    report = {"reference": "transformers" if not weights else "transformers with the engine's weights",
              "sequences": len(sequences), "positions": sum(lengths), "max_abs_error": error,
              "tolerance": bar.tolerance, "greedy_agreement": agree,
              **({} if bar.spread is None else {"relative_error_median": bar.measured,
                                                "relative_error_max": float(bar.spread.max()),
                                                "tolerance_on": "relative_error_median"}),
              "engine_device": device, "reference_device": on_gpu.get("device", "cpu"),
              "reference_dtype": on_gpu.get("dtype", "float32")}
    against = "transformers" if not weights else "transformers running the engine's own dequantized weights"
    same = weights is not None and not weights  # nothing replaced: the reference is the float model itself
    minimum = f" (minimum verify.min_greedy_agreement {options.min_greedy_agreement})" if quant.mode != "none" and same else ""
    said = (f"max |logit error| {error:.3g} (tolerance {bar.tolerance:.3g} = {bar.why})" if bar.spread is None else
            f"max |logit error| {error:.3g}; relative to the reference's spread (RMS error / the reference logits' "
            f"standard deviation, per position) median {bar.measured:.3g} (tolerance {bar.tolerance:.3g} = {bar.why}), "
            f"largest {bar.spread.max():.3g}")
    log(f"verify: engine vs {against}: {said}, greedy agreement {agree:.3f} over {sum(lengths)} positions{minimum}")
    if quant.mode != "none":  # against the float model too; the same comparison (a GGUF file's integers): one line
        report["float_model"] = _float_check(model_dir, sequences, ours, options, log, theirs if same else None)
        passed = passed and report["float_model"]["passed"]
    log(f"verify: {'ok' if passed else 'FAILED'}")
    return dict(report, passed=passed)


class Bar(NamedTuple):
    """What the engine's logits are held to: `measured` <= `tolerance`, and why that tolerance."""

    measured: float
    tolerance: float
    why: str
    spread: np.ndarray | None  # relative_errors, where their median is what is measured


def _bar(ours, theirs, error: float, options: Verify, dtype: str, rounded: str, gguf: bool) -> Bar:
    """max |logit error| within verify.tolerance (x DTYPE_TOLERANCE); where the engine rounds at run time
    (`rounded` says what), within verify.quantized_tolerance x the largest reference logit, or, for a GGUF file's
    engine, the median position's relative error (relative_errors) within verify.quantized_tolerance."""
    tolerance = options.tolerance * DTYPE_TOLERANCE[dtype]
    why = f"verify.tolerance {options.tolerance:g}" + (f" x {DTYPE_TOLERANCE[dtype]:g} for {dtype}" if dtype != "float32" else "")
    if not rounded:
        return Bar(error, tolerance, why, None)
    if gguf:
        spread = relative_errors(ours, theirs)
        return Bar(float(np.median(spread)), options.quantized_tolerance, (
            f"verify.quantized_tolerance {options.quantized_tolerance:g} on the median position: the engine rounds "
            f"{rounded} at run time, the reference (the file's weights in float) does not; random tokens drive that "
            f"rounding far at a few positions, a wrong weight moves every one"), spread)
    largest = max(float(np.abs(t).max()) for t in theirs)
    if options.quantized_tolerance * largest <= tolerance:
        return Bar(error, tolerance, why, None)
    return Bar(error, options.quantized_tolerance * largest, (
        f"verify.quantized_tolerance {options.quantized_tolerance:g} x the largest |logit| {largest:.3g}: "
        f"the engine rounds {rounded} at run time, the reference does not"), None)


def _is_gguf(model_dir: Path) -> bool:
    from builder.gguf.checkpoint import is_staged

    return is_staged(model_dir)


def _float_check(model_dir: Path, sequences, ours, options: Verify, log, reference=None) -> dict:
    """The engine against the float model (`reference`: its logits, already compared and said, when the
    verification's reference was the float model itself; then nothing more is logged)."""
    error, agree = compare(ours, reference if reference is not None else reference_logits(model_dir, sequences))
    passed = agree >= options.min_greedy_agreement
    if reference is None:
        log(f"verify: engine vs the float model (what quantization costs, not an error bound): max |logit error| "
            f"{error:.3g}, greedy agreement {agree:.3f} (minimum verify.min_greedy_agreement {options.min_greedy_agreement})")
    return {"max_abs_error": error, "greedy_agreement": agree,
            "min_greedy_agreement": options.min_greedy_agreement, "passed": passed}
