"""Build an engine directory from a recipe: trace, run the pipeline, lower, copy the tokenizer,
write manifest.json, verify against transformers. Everything goes to a temporary directory that is
renamed into place at the end, so an interrupted or failed build never leaves a half engine."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from builder.bf16_twin import check_bfloat16_engine
from builder.build_tp import build_tensor_parallel
from builder.gguf.checkpoint import staged_recipe
from builder.engine_dir import BuildError, build_manifest, copy_tokenizer, weight_progress, write_manifest
from builder.lower_onnx import lower_to_onnx
from builder.output_dir import check_output, discard_partial, remove_stale, replace, start_partial
from builder.pass_manager import PassManager
from builder.ir import Graph
from builder.pipeline import pipeline
from builder.quant import effective_weights
from builder.recipe import Recipe, RecipeError, Verify
from builder.reference_check import check_engine, verification_device
from builder.trace import trace
from runtime.manifest.load import draft_mismatch, read_manifest
from runtime.manifest.types import Speculative

__all__ = ["BuildError", "VerificationFailed", "build_engine", "refuse_unsupported"]


class VerificationFailed(BuildError):
    """The built engine disagrees with transformers beyond the recipe's tolerance (engine-build exits 1)."""


def refuse_unsupported(recipe: Recipe) -> None:
    """Recipe features whose issues have not landed yet are refused up front, by name."""
    if recipe.target.backend != "onnxruntime":
        raise RecipeError(f"target.backend {recipe.target.backend!r} is not supported yet; use 'onnxruntime'")


def build_engine(recipe: Recipe, out: str | Path | None = None, dump_ir: str | Path | None = None,
                 log: Callable[[str], None] = print) -> Path:
    """Build the engine described by `recipe` into `out` (or recipe.out) and return its path.
    `out` must be absent, empty or an engine (builder/output_dir.py); it is replaced only at the end."""
    refuse_unsupported(recipe)
    out = Path(out or recipe.out or f"engines/{Path(recipe.model).name}")
    recipe = staged_recipe(recipe, log)  # a .gguf model reads as a staged checkpoint directory (builder/gguf/)
    model_dir = _checkpoint_dir(recipe.model, "model")
    sources = [model_dir] + ([Path(recipe.speculative.draft_model)] if recipe.speculative.draft_model else [])
    check_output(out, sources)
    remove_stale(out, log)
    tmp = start_partial(out)
    try:
        if recipe.parallel.tensor_parallel > 1:
            build_tensor_parallel(tmp, recipe, model_dir, dump_ir, log)
        else:
            _build_into(tmp, recipe, model_dir, dump_ir, log)
        if recipe.speculative.enabled:
            _build_draft(tmp, recipe, log)
        replace(tmp, out)
    except BaseException:
        discard_partial(tmp)
        raise
    return out


def _checkpoint_dir(path: str, field: str) -> Path:
    """The checkpoint directory, or a BuildError that says how the committed recipes' checkpoints are made."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        hint = (f"; make it with `python -m tools.checkpoints.make_checkpoint {path}`" if "checkpoints/random" in path
                else "; give a local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)")
        raise BuildError(f"{field} {path!r}: no such checkpoint directory{hint}")
    return model_dir


def _build_draft(tmp: Path, recipe: Recipe, log) -> None:
    """Build the draft engine into `<engine>/draft` and record the pair in the target's manifest."""
    draft = recipe.draft_recipe()
    _checkpoint_dir(draft.model, "speculative.draft_model")
    log(f"building the draft engine from {draft.model} (quantization {draft.quantization.mode})")
    (tmp / "draft").mkdir()
    _build_into(tmp / "draft", draft, Path(draft.model), None, log)
    manifest = read_manifest(tmp, check_files=False)
    if problem := draft_mismatch(manifest, read_manifest(tmp / "draft", check_files=False)):  # as LLM(draft=) checks
        raise BuildError(f"speculative: {problem}")
    write_manifest(tmp, manifest.replace(speculative=Speculative(
        draft_dir="draft", draft_model=draft.model, draft_quantization=draft.quantization.mode,
        num_draft_tokens=recipe.speculative.num_draft_tokens)))


def _build_into(tmp: Path, recipe: Recipe, model_dir: Path, dump_ir, log) -> None:
    start = time.perf_counter()
    graph = trace(model_dir)
    params = graph.num_parameters()  # of the model; quantized parts would count packed bytes
    log(f"traced {graph.name}: {len(graph.nodes)} nodes, {params / 1e6:.1f}M parameters")
    manager = PassManager(pipeline(recipe), Path(dump_ir) if dump_ir else None)
    graph = manager.run(graph)
    for t in manager.timings:
        log(f"  pass {t.phase}/{t.name}: {t.seconds * 1e3:.1f} ms{' (disabled)' if t.disabled else ''}, "
            f"{t.nodes_after} nodes")
    io = lower_to_onnx(graph, tmp / "model.onnx", recipe.target.dtype, progress=weight_progress(graph, log))
    copy_tokenizer(model_dir, tmp)
    manifest = write_manifest(tmp, build_manifest(graph, params, recipe, model_dir, io, manager,
                                              time.perf_counter() - start))
    if _should_verify(recipe, params, log):
        report = _reference_check(tmp, model_dir, graph, recipe.verify, log)
        write_manifest(tmp, manifest.replace(verification=report))
        if not report["passed"]:
            raise VerificationFailed(f"verification failed: {_failure(report)}; no engine written")
    log(f"built in {time.perf_counter() - start:.1f} s")


def _failure(report: dict) -> str:
    text = (f"max |logit error| {report['max_abs_error']:.3g} (tolerance {report['tolerance']:.3g}), "
            f"greedy agreement {report['greedy_agreement']:.3f}")
    float_model = report.get("float_model")
    if float_model is not None:
        text += (f"; against the float model greedy agreement {float_model['greedy_agreement']:.3f} "
                 f"(minimum {float_model['min_greedy_agreement']})")
    return text


def _reference_check(engine_dir: Path, model_dir: Path, graph: Graph, options: Verify, log) -> dict:
    """The build's verification against transformers (builder/reference_check.py), with the effective weights
    of a quantized graph; a bfloat16 engine that cannot run here is checked through its float32 twin
    (builder/bf16_twin.py)."""
    manifest = read_manifest(engine_dir, check_files=False)
    if manifest.target.dtype == "bfloat16" and verification_device(manifest) == "cpu":
        return check_bfloat16_engine(graph, engine_dir, model_dir, options, log)
    weights = effective_weights(graph) if graph.meta.quantization.mode != "none" else None
    return check_engine(engine_dir, model_dir, options, log, weights)


def _should_verify(recipe: Recipe, params: int, log) -> bool:
    import onnxruntime

    mode = recipe.verify.enabled
    wanted = mode == "on" or (mode == "auto" and params <= recipe.verify.auto_max_params)
    if wanted and recipe.target.attention == "paged" and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        if mode == "on":  # PagedAttention has no CPU kernel
            raise BuildError("verify.enabled is on but a paged engine runs only on CUDA (PagedAttention has no CPU "
                             "kernel) and this machine has no CUDAExecutionProvider; build with --no-verify here")
        log("verify: skipped, a paged engine runs only on CUDA (PagedAttention has no CPU kernel)")
        return False
    if wanted and recipe.target.device == "cuda" and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        if recipe.target.dtype == "float16":
            log("verify: no CUDA here; the float16 engine is checked with ONNX Runtime's CPU execution provider")
            return True
        if recipe.quantization.mode == "none":  # bfloat16: its float32 twin (builder/bf16_twin.py)
            return True
        if mode == "on":
            raise BuildError(f"verify.enabled is on but this machine cannot run a cuda {recipe.target.dtype} engine "
                             f"(no CUDAExecutionProvider); build with --no-verify here and verify on the GPU machine")
        log(f"verify: skipped, a quantized cuda {recipe.target.dtype} engine cannot be checked on this machine's CPU")
        return False
    return wanted
