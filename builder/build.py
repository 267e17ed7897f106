"""Build an engine directory from a recipe, one path for one rank and N: trace, run the pipeline for each
rank, lower (one `model.onnx`, or each rank's segments), copy the tokenizer, verify against transformers,
and write manifest.json once, from the manifest kept in memory. Everything goes to a temporary directory
that is renamed into place at the end, so an interrupted or failed build never leaves a half engine."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

from builder.bf16_twin import check_bfloat16_engine
from builder.gguf.checkpoint import as_given, staged_recipe
from builder.engine_dir import BuildError, build_manifest, copy_tokenizer, weight_progress, write_manifest
from builder.lower_onnx import lower_to_onnx
from builder.output_dir import check_output, discard_partial, remove_stale, replace, start_partial
from builder.pass_manager import PassManager
from builder.ir import Graph
from builder.pipeline import pipeline
from builder.quant import effective_weights
from builder.recipe import Recipe, RecipeError, Verify
from builder.reference_check import check_engine, verification_device
from builder.segments import segments_io, write_rank
from builder.trace import trace
from runtime.manifest.load import Manifest, draft_mismatch
from runtime.manifest.types import IO, Speculative, TensorParallel, TensorParallelRank

__all__ = ["BuildError", "VerificationFailed", "build_engine", "refuse_unsupported"]


class VerificationFailed(BuildError):
    """The built engine disagrees with transformers beyond the recipe's tolerance (engine-build exits 1)."""


def refuse_unsupported(recipe: Recipe) -> None:
    """Recipe features whose issues have not landed yet are refused up front, by name."""
    if recipe.target.backend != "onnxruntime":
        raise RecipeError(f"target.backend {recipe.target.backend!r} is not supported yet; use 'onnxruntime'")
    if recipe.parallel.tensor_parallel > 1 and recipe.speculative.enabled:
        raise BuildError("speculative: a draft engine inside a tensor_parallel > 1 engine is not supported; "
                         "build the draft on its own and load it with LLM(engine, draft=DIR)")
    if recipe.parallel.tensor_parallel > 1 and recipe.verify.enabled == "on":
        raise BuildError("verify.enabled on is not supported with tensor_parallel > 1 (the build-time check "
                         "runs one whole engine); use auto or off and check the engine with its tests")


def build_engine(recipe: Recipe, out: str | Path | None = None, dump_ir: str | Path | None = None,
                 log: Callable[[str], None] = print) -> Path:
    """Build the engine described by `recipe` into `out` (or recipe.out) and return its path.
    `out` must be absent, empty or an engine (builder/output_dir.py); it is replaced only at the end."""
    refuse_unsupported(recipe)
    out = Path(out or recipe.out or f"engines/{Path(recipe.model).name}")
    given, recipe = recipe, staged_recipe(recipe, log)  # a .gguf file reads as a staged directory (builder/gguf/)
    model_dir = _checkpoint_dir(recipe.model, "model")
    sources = [model_dir] + ([Path(recipe.speculative.draft_model)] if recipe.speculative.draft_model else [])
    check_output(out, sources)
    remove_stale(out, log)
    tmp = start_partial(out)
    try:
        manifest = _as_given(_build_into(tmp, recipe, model_dir, dump_ir, log), given)
        if recipe.speculative.enabled:
            manifest = manifest.replace(speculative=_build_draft(tmp, recipe, given, manifest, log))
        write_manifest(tmp, manifest)
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
        where = "" if model_dir.is_absolute() else f" ({model_dir.absolute()}: a relative path is resolved against the working directory)"
        raise BuildError(f"{field} {path!r}: no such checkpoint directory{where}{hint}")
    return model_dir


def _as_given(manifest: Manifest, given: Recipe) -> Manifest:
    """The manifest naming the checkpoint as the recipe gave it: a GGUF file, not its staged directory (which
    quantization.source.staged names)."""
    return manifest.replace(recipe=given.to_dict(),
                            model=dataclasses.replace(manifest.model, source=as_given(manifest.model.source)))


def _build_draft(tmp: Path, recipe: Recipe, given: Recipe, manifest: Manifest, log) -> Speculative:
    """Build the draft engine into `<engine>/draft`; returns the target manifest's record of the pair.
    `given`: the recipe as given (a GGUF draft_model named as the file)."""
    if recipe.speculative.eagle:  # an EAGLE head: a one-layer engine of its own (builder/eagle_head.py)
        from builder.eagle_head import build_eagle_head

        return build_eagle_head(Path(recipe.speculative.draft_model), tmp / "draft", recipe, manifest, tmp, log)
    draft = recipe.draft_recipe()
    _checkpoint_dir(draft.model, "speculative.draft_model")
    log(f"building the draft engine from {draft.model} (quantization {draft.quantization.mode})")
    (tmp / "draft").mkdir()
    given_draft = given.draft_recipe()
    draft_manifest = _as_given(_build_into(tmp / "draft", draft, Path(draft.model), None, log), given_draft)
    if problem := draft_mismatch(manifest, draft_manifest):  # as LLM(draft=) checks
        raise BuildError(f"speculative: {problem}")
    write_manifest(tmp / "draft", draft_manifest)
    return Speculative(draft_dir="draft", draft_model=given_draft.model, draft_quantization=draft.quantization.mode,
                       num_draft_tokens=recipe.speculative.num_draft_tokens)


def _build_into(tmp: Path, recipe: Recipe, model_dir: Path, dump_ir, log) -> Manifest:
    """Trace once, run the pipeline and write the engine's graph for each rank (builder/segments.py splits a
    tensor-parallel rank's), copy the tokenizer, verify. Returns the engine's manifest; the caller writes it."""
    start = time.perf_counter()
    graph = trace(model_dir)
    params = graph.num_parameters()  # of the model; quantized parts would count packed bytes
    log(f"traced {graph.name}: {len(graph.nodes)} nodes, {params / 1e6:.1f}M parameters")
    lowered, manager, io, section = _write_ranks(tmp, graph, recipe, dump_ir, log)
    copy_tokenizer(model_dir, tmp)
    manifest = build_manifest(lowered, params, recipe, model_dir, io, manager, time.perf_counter() - start)
    if section is not None:
        log(f"verify: skipped for a tensor_parallel {section.size} engine (tests compare sharded engines with "
            f"transformers)")
        manifest = manifest.replace(tensor_parallel=section, verification={
            "skipped": "tensor_parallel > 1: the build-time check is not run on sharded engines"})
    elif _should_verify(recipe, params, log):
        report = _reference_check(tmp, manifest, model_dir, lowered, recipe.verify, log)
        manifest = manifest.replace(verification=report)
        if not report["passed"]:
            raise VerificationFailed(f"verification failed: {_failure(report)}; no engine written")
    log(f"built in {time.perf_counter() - start:.1f} s")
    return manifest


def _write_ranks(tmp: Path, graph: Graph, recipe: Recipe, dump_ir, log
                 ) -> tuple[Graph, PassManager, IO, TensorParallel | None]:
    """Each rank's pipeline on the traced graph, lowered into `tmp`: one rank to `model.onnx`, N ranks to their
    segments. Returns rank 0's graph and passes, the engine's interface and, for N ranks, the manifest's
    tensor_parallel section."""
    tp, dtype = recipe.parallel.tensor_parallel, recipe.target.dtype
    ranks, collectives, first = [], [], None
    for rank in range(tp):
        dump = None if not dump_ir else Path(dump_ir) / f"rank{rank}" if tp > 1 else Path(dump_ir)
        manager = PassManager(pipeline(recipe, rank), dump)
        lowered = manager.run(graph)
        _log_passes(manager, lowered, rank, tp, log)
        if tp == 1:
            io = lower_to_onnx(lowered, tmp / "model.onnx", dtype, weight_progress(lowered, log))
            return lowered, manager, io, None
        segments, collectives = write_rank(lowered, tmp, rank, dtype, weight_progress(lowered, log))
        ranks.append(TensorParallelRank(rank=rank, segments=tuple(segments)))
        first = first or (lowered, manager)
    section = TensorParallel(size=tp, ranks=tuple(ranks), collectives=tuple(collectives),
                             replicated=("embedding", "lm_head (run by rank 0 only)"))
    return first[0], first[1], segments_io(first[0]), section


def _log_passes(manager: PassManager, graph: Graph, rank: int, tp: int, log) -> None:
    """Each pass's time and node count (the first rank's; the other ranks' node counts only)."""
    if rank > 0:
        return log(f"rank {rank}/{tp}: {len(graph.nodes)} nodes after the pipeline")
    for t in manager.timings:
        log(f"  pass {t.phase}/{t.name}: {t.seconds * 1e3:.1f} ms{' (disabled)' if t.disabled else ''}, "
            f"{t.nodes_after} nodes")


def _failure(report: dict) -> str:
    text = (f"max |logit error| {report['max_abs_error']:.3g} (tolerance {report['tolerance']:.3g}), "
            f"greedy agreement {report['greedy_agreement']:.3f}")
    float_model = report.get("float_model")
    if float_model is not None:
        text += (f"; against the float model greedy agreement {float_model['greedy_agreement']:.3f} "
                 f"(minimum {float_model['min_greedy_agreement']})")
    return text


def _reference_check(engine_dir: Path, manifest: Manifest, model_dir: Path, graph: Graph, options: Verify,
                     log) -> dict:
    """The build's verification against transformers (builder/reference_check.py) of the engine written in
    `engine_dir` with `manifest` (not written yet), with the effective weights of a quantized graph; a bfloat16
    engine that cannot run here is checked through its float32 twin (builder/bf16_twin.py)."""
    if manifest.target.dtype == "bfloat16" and verification_device(manifest) == "cpu":
        return check_bfloat16_engine(graph, manifest, model_dir, options, log)
    weights = effective_weights(graph) if graph.meta.quantization.mode != "none" else None
    return check_engine(engine_dir, model_dir, options, log, weights, manifest)


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
