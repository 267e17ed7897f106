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
from builder.gguf.checkpoint import as_given, import_format, staged_recipe
from builder.engine_dir import BuildError, build_manifest, copy_tokenizer, weight_progress, write_manifest
from builder.lower_onnx import lower_to_onnx
from builder.output_dir import check_output, discard_partial, remove_stale, replace, start_partial
from builder.pass_manager import PassManager
from builder.ir import Graph
from builder.pipeline import pipeline
from builder.quant import effective_weights
from builder.quant.kernels import KernelTable
from builder.recipe import Recipe, RecipeError, Verify
from builder.reference_check import check_engine, verification_device
from builder.pipeline_stages import StageError, layer_costs, plan_stages, write_stages
from builder.segments import segments_io, write_rank
from builder.trace import trace
from runtime.manifest.load import Manifest, draft_mismatch
from runtime.manifest.types import IO, PipelineParallel, Speculative, TensorParallel, TensorParallelRank
from runtime.model.weight_kernels import FPA_INTB_BLOCKS

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
                         "does not run sharded engines); use auto or off and check the engine with its tests")


def note_weight_kernels(recipe: Recipe, log: Callable[[str], None]) -> None:
    """Say so when a CUDA engine asks for TensorRT-LLM's weight-only kernels with blocks they do not take."""
    quant, target = recipe.quantization, recipe.target
    if (target.device == "cuda" and target.weight_kernels == "fpa_intb" and quant.mode != "none"
            and quant.group_size not in FPA_INTB_BLOCKS):
        log(f"note: target.weight_kernels fpa_intb runs blocks of {' or '.join(map(str, FPA_INTB_BLOCKS))}; "
            f"quantization.group_size {quant.group_size} keeps ONNX Runtime's own kernels "
            f"(--set quantization.group_size=128)")


def refuse_requantizing(recipe: Recipe, given: Recipe) -> None:
    """A pre-quantized checkpoint (a GGUF file, a GPTQ/AWQ/compressed-tensors one) keeps its own integers: a
    quantization.mode of the recipe's own is refused before any tracing (QuantizeWeights would refuse it after)."""
    pairs = [("quantization.mode", recipe, given.model)]
    if recipe.speculative.enabled:
        draft = recipe.draft_recipe()
        field = "speculative.draft_quantization" if recipe.speculative.draft_model else "speculative.self_draft"
        pairs.append((field, draft, given.speculative.draft_model or given.model))
    for field, built, named in pairs:
        if built.quantization.mode != "none" and Path(built.model).is_dir() and (fmt := import_format(built.model)):
            kind = "a GGUF file" if fmt.record()["format"] == "gguf" else f"{fmt.record()['format']}-quantized"
            raise RecipeError(f"{field} {built.quantization.mode}: {named} is already quantized ({kind}), and its "
                              f"integers are imported as they are; allowed: quantization.mode none (accuracy_level "
                              f"still applies)")


def build_engine(recipe: Recipe, out: str | Path | None = None, dump_ir: str | Path | None = None,
                 log: Callable[[str], None] = print) -> Path:
    """Build the engine described by `recipe` into `out` (or recipe.out) and return its path.
    `out` must be absent, empty or an engine (builder/output_dir.py); it is replaced only at the end."""
    refuse_unsupported(recipe)
    note_weight_kernels(recipe, log)
    out = Path(out or recipe.out or f"engines/{Path(recipe.model).name}")
    given, recipe = recipe, staged_recipe(recipe, log)  # a .gguf file reads as a staged directory (builder/gguf/)
    model_dir = _checkpoint_dir(recipe.model, "model")
    refuse_requantizing(recipe, given)
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
    if recipe.parallel.pipeline_parallel > 1:  # the split is checked before any weight is read
        lowered, manager, io, section = _write_stages(tmp, graph, recipe, dump_ir, log)
    else:
        lowered, manager, io, section = _write_ranks(tmp, graph, recipe, dump_ir, log)
    copy_tokenizer(model_dir, tmp)
    manifest = build_manifest(lowered, params, recipe, model_dir, io, manager, time.perf_counter() - start)
    skipped = _unchecked(section)
    verify = skipped is None and _should_verify(recipe, params, log)
    if recipe.quantization.activation_block == "auto" and recipe.quantization.accuracy_level != "auto":
        log("kernels: activation_block auto is measured by accuracy_level auto's kernel choice; with explicit levels "
            "every matmul keeps its stored block")
    if recipe.quantization.accuracy_level == "auto" and section is None:
        manifest = _choose_kernels(tmp, manifest, model_dir, lowered, recipe, verify, log,
                                   lambda kinds: _rewrite_blocks(tmp, graph, recipe, kinds))
    elif recipe.quantization.accuracy_level == "auto" and "matmuls" in (manifest.quantization.record or {}):
        log("kernels: each matmul at its table's fastest kernel; accuracy not measured (the kernel choice runs "
            "on one-graph engines only)")
    if section is not None:
        kind = "pipeline_parallel" if isinstance(section, PipelineParallel) else "tensor_parallel"
        manifest = manifest.replace(**{kind: section})
    if skipped:
        log(f"verify: skipped, {skipped} (tests compare sharded engines with transformers)")
        manifest = manifest.replace(verification={"skipped": skipped})
    elif verify:
        if section is not None:  # the stage processes read it from the directory (runtime/parallel/stage.py)
            write_manifest(tmp, manifest)
        report = _reference_check(tmp, manifest, model_dir, lowered, recipe.verify, log)
        manifest = manifest.replace(verification=report)
        if not report["passed"]:
            raise VerificationFailed(f"verification failed: {_failure(report)}; no engine written")
    log(f"built in {time.perf_counter() - start:.1f} s")
    return manifest


def _unchecked(section: TensorParallel | PipelineParallel | None) -> str | None:
    """Why the build-time check is not run on an engine of this layout, or None: one graph and pipeline stages
    (run as the runtime runs them) are checked, tensor-parallel shards are not."""
    if isinstance(section, TensorParallel):
        return "tensor_parallel > 1: the build-time check is not run on sharded engines"
    if isinstance(section, PipelineParallel) and section.tensor_parallel > 1:
        return (f"pipeline_parallel {section.size} x tensor_parallel {section.tensor_parallel}: the build-time check "
                f"is not run on sharded engines")
    return None


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


def _write_stages(tmp: Path, graph: Graph, recipe: Recipe, dump_ir, log
                  ) -> tuple[Graph, PassManager, IO, PipelineParallel]:
    """A pipeline-parallel engine: the stages' layer ranges planned on the traced graph (a bad split refused
    before any weight is read), the pipeline run once per tensor-parallel rank (a shard that cannot be made is
    refused by rank 0's, before any weight is read), each stage of each rank lowered apart
    (builder/pipeline_stages.py)."""
    options = recipe.parallel
    num_layers = sum(1 for _ in graph.nodes_of("Attention"))
    costs, rest = layer_costs(graph, num_layers, KernelTable.for_this_cpu())  # per-token compute, not bytes
    try:
        ranges = plan_stages(num_layers, options.pipeline_parallel, options.pipeline_layers, costs, rest)
    except StageError as err:
        raise BuildError(str(err)) from None
    log(f"pipeline stages: layers {', '.join(f'[{a}, {b})' for a, b in ranges)}")
    tp, graphs, first = options.tensor_parallel, [], None
    for rank in range(tp):  # each tensor-parallel rank's pipeline (its shard), then its stages
        dump = None if not dump_ir else Path(dump_ir) / f"rank{rank}" if tp > 1 else Path(dump_ir)
        manager = PassManager(pipeline(recipe, rank), dump)
        graphs.append(manager.run(graph))
        _log_passes(manager, graphs[-1], rank, tp, log)
        first = first or manager
    section = write_stages(graphs, tmp, ranges, recipe.target.dtype, weight_progress(graphs[0], log))
    return graphs[0], first, segments_io(graphs[0]), section


def _log_passes(manager: PassManager, graph: Graph, rank: int, tp: int, log) -> None:
    """Each pass's time and node count (the first rank's; the other ranks' node counts only)."""
    if rank > 0:
        return log(f"rank {rank}/{tp}: {len(graph.nodes)} nodes after the pipeline")
    for t in manager.timings:
        log(f"  pass {t.phase}/{t.name}: {t.seconds * 1e3:.1f} ms{' (disabled)' if t.disabled else ''}, "
            f"{t.nodes_after} nodes")
    imported = graph.meta.quantization.record.get("experts", {}) if graph.meta.quantization else {}
    for node, how in imported.items():  # a pre-quantized checkpoint's experts: own integers, or float and why
        if "experts" in how:
            log(f"  experts of {node}: {how['experts']}")


def _failure(report: dict) -> str:
    measured = (f"median logit error relative to the reference's spread {report['relative_error_median']:.3g}"
                if report.get("tolerance_on") == "relative_error_median" else
                f"max |logit error| {report['max_abs_error']:.3g}")
    text = f"{measured} (tolerance {report['tolerance']:.3g}), greedy agreement {report['greedy_agreement']:.3f}"
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


def _choose_kernels(tmp: Path, manifest: Manifest, model_dir: Path, graph: Graph, recipe: Recipe, measure: bool,
                    log, rewrite: Callable[[frozenset[str]], None]) -> Manifest:
    """`accuracy_level: auto`: measured against the float reference where the build runs it (verify on), else
    the table's choice as it stands, recorded as not measured (builder/kernel_choice.py). `rewrite(kinds)` writes
    the engine again with those kinds' int8 activations in smaller blocks, a step the choice may take (and, with
    `activation_block: auto`, measures for every kind before the budget's search)."""
    from builder.kernel_choice import Budget, choose_kernels
    from builder.reference_check import reference_logits

    if manifest.quantization.mode == "none" or "matmuls" not in manifest.quantization.record:
        return manifest
    auto_blocks = recipe.quantization.activation_block == "auto"
    if not measure:
        log("kernels: each matmul at its table's fastest kernel; accuracy not measured (no float reference run: "
            "verify off)" + ("; activation_block auto: nothing re-blocked" if auto_blocks else ""))
        record = dict(manifest.quantization.record, kernel_choice={"measured": False})
        return manifest.replace(quantization=type(manifest.quantization)(manifest.quantization.mode, record))
    weights = effective_weights(graph)
    quant = recipe.quantization
    budget = Budget(quant.accuracy_budget, quant.accuracy_top1_budget, quant.accuracy_kl_budget)
    return choose_kernels(tmp, manifest, model_dir, budget, recipe.quantization.calibration,
                          lambda seqs: reference_logits(model_dir, seqs, weights), log, rewrite, auto_blocks)


def _rewrite_blocks(tmp: Path, traced: Graph, recipe: Recipe, kinds: frozenset[str]) -> None:
    """The engine's graph written again into `tmp` with `kinds`' int8 activations in blocks of the kernel choice's
    SMALL_BLOCK besides the recipe's `quantization.activation_block` (the weights re-blocked exactly); every matmul
    at level 4 here, the kernel choice writes its levels after."""
    from builder.kernel_choice import SMALL_BLOCK

    given = recipe.quantization.activation_block
    blocks = {"default": given} if isinstance(given, int) else dict(given) if isinstance(given, dict) else {}
    blocks.update(dict.fromkeys(sorted(kinds), SMALL_BLOCK))
    quant = dataclasses.replace(recipe.quantization, accuracy_level=4, activation_block=blocks or None)
    _write_ranks(tmp, traced, dataclasses.replace(recipe, quantization=quant), None, lambda _: None)


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
        pp = recipe.parallel.pipeline_parallel
        if recipe.quantization.mode == "none" and pp == 1:  # bfloat16: its float32 twin (builder/bf16_twin.py)
            return True
        if mode == "on":
            raise BuildError(f"verify.enabled is on but this machine cannot run a cuda {recipe.target.dtype} engine "
                             f"(no CUDAExecutionProvider); build with --no-verify here and verify on the GPU machine")
        what, why = ("quantized", "") if pp == 1 else (f"pipeline_parallel {pp}", " (its float32 twin is one graph)")
        log(f"verify: skipped, a {what} cuda {recipe.target.dtype} engine cannot be checked on this machine's CPU{why}")
        return False
    return wanted
