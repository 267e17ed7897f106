"""Build an engine directory from a recipe: trace, run the pipeline, lower, copy the tokenizer,
write manifest.json, verify against transformers. Everything goes to a temporary directory that is
renamed into place at the end, so an interrupted or failed build never leaves a half engine."""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from builder import __version__
from builder.ir import Graph
from builder.lower_onnx import OPSET, lower_to_onnx
from builder.output_dir import check_output, discard_partial, remove_stale, replace, start_partial
from builder.pass_manager import PassManager
from builder.pipeline import pipeline
from builder.recipe import Recipe, RecipeError
from builder.trace import trace
from runtime.manifest.load import MANIFEST, Manifest, draft_mismatch, read_manifest, with_files
from runtime.manifest.types import (IO, CudaGraphs, Limits, ModelInfo, PassTiming, Quantization, Rope, SamplingHead,
                                    Speculative, Target, Tokens, from_json)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")


class BuildError(RuntimeError):
    """The build was refused or failed; no engine directory was written."""


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
    model_dir = _checkpoint_dir(recipe.model, "model")
    sources = [model_dir] + ([Path(recipe.speculative.draft_model)] if recipe.speculative.draft_model else [])
    check_output(out, sources)
    remove_stale(out, log)
    tmp = start_partial(out)
    try:
        if recipe.parallel.tensor_parallel > 1:
            from builder.build_tp import build_tensor_parallel

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
    _write_manifest(tmp, manifest.replace(speculative=Speculative(
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
    io = lower_to_onnx(graph, tmp / "model.onnx", recipe.target.dtype, progress=_progress(graph, log))
    _copy_tokenizer(model_dir, tmp)
    manifest = _write_manifest(tmp, _manifest(graph, params, recipe, model_dir, io, manager,
                                              time.perf_counter() - start))
    if _should_verify(recipe, params, log):
        from builder.reference_check import check_build

        report = check_build(tmp, model_dir, graph, recipe.verify, log)
        _write_manifest(tmp, manifest.replace(verification=report))
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


def _progress(graph: Graph, log) -> Callable[[str], None]:
    from tqdm import tqdm

    bar = tqdm(total=len(graph.weights), desc="writing weights", unit="tensor", leave=False,
               disable=None)
    return lambda name: bar.update(1)


def _should_verify(recipe: Recipe, params: int, log) -> bool:
    import onnxruntime

    mode = recipe.verify.enabled
    wanted = mode == "on" or (mode == "auto" and params <= recipe.verify.auto_max_params)
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


def _copy_tokenizer(model_dir: Path, tmp: Path) -> None:
    if not (model_dir / "tokenizer.json").is_file():
        raise BuildError(f"{model_dir}: no tokenizer.json; the runtime needs the fast-tokenizer file "
                         f"(save the tokenizer with transformers' save_pretrained)")
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, tmp / name)


def _special_tokens(model_dir: Path, config: dict) -> Tokens:
    generation = {}
    if (model_dir / "generation_config.json").is_file():
        generation = json.loads((model_dir / "generation_config.json").read_text())

    def pick(key):
        value = generation.get(key, config.get(key))
        return value

    eos = pick("eos_token_id")
    return Tokens(bos_token_id=pick("bos_token_id"), pad_token_id=pick("pad_token_id"),
                  eos_token_ids=() if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos)))


def _manifest(graph: Graph, params: int, recipe: Recipe, model_dir: Path, io, manager: PassManager,
              seconds: float) -> Manifest:
    import onnx
    import onnxruntime

    config_bytes = (model_dir / "config.json").read_bytes()
    config = json.loads(config_bytes)
    meta = graph.meta
    kv = meta["kv_cache"]
    return Manifest(
        builder_version=__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        model=ModelInfo(family=meta["family"], architecture=meta["architecture"], source=str(model_dir.resolve()),
                        config_sha256=hashlib.sha256(config_bytes).hexdigest(), hyperparameters=meta["hyperparameters"],
                        num_parameters=params, tokens=_special_tokens(model_dir, config)),
        recipe=recipe.to_dict(),
        target=Target(backend=recipe.target.backend, device=recipe.target.device, dtype=recipe.target.dtype,
                      onnx_opset=OPSET, contrib_ops=tuple(_contrib_ops(graph)),
                      built_with={"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}),
        limits=Limits(max_batch_size=kv.slots, max_seq_len=kv.max_seq_len, max_seq_len_cap=meta["max_seq_len_cap"]),
        kv_cache=kv,
        rope=from_json(Rope, meta["rope"], "rope"),
        quantization=from_json(Quantization, meta.get("quantization", {"mode": "none"}), "quantization"),
        io=IO(inputs=io.inputs, outputs=io.outputs),
        sampling_head=from_json(SamplingHead, meta["sampling_head"], "sampling_head") if "sampling_head" in meta
        else None,
        cuda_graphs=from_json(CudaGraphs, meta.get("cuda_graphs", {}), "cuda_graphs"),
        passes=tuple(PassTiming(phase=t.phase, name=t.name, seconds=round(t.seconds, 6), disabled=t.disabled)
                     for t in manager.timings),
        build_seconds=round(seconds, 3),
    )


def _contrib_ops(graph: Graph) -> list[str]:
    ops = ["GroupQueryAttention", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"]
    return ops + (["MatMulNBits"] if any(graph.nodes_of("QuantLinear")) else [])


def _write_manifest(directory: Path, manifest: Manifest) -> Manifest:
    """Write `manifest` with the hashes of the directory's files, read back as the runtime reads it (so
    what the builder writes always passes the runtime's checks); returns what was written."""
    manifest = Manifest.from_dict(json.loads(with_files(manifest, directory).to_json()))
    (directory / MANIFEST).write_text(manifest.to_json())
    return manifest
