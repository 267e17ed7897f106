"""An engine directory's files beside the graph: the tokenizer files and manifest.json (the typed manifest
built from the traced graph, the recipe and the pass timings, with every file's hash), for builder/build.py,
which keeps the manifest in memory through the build and writes it once."""
from __future__ import annotations

import hashlib
import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from builder import __version__
from builder.ir import Graph
from builder.lower_onnx import OPSET
from builder.pass_manager import PassManager
from builder.recipe import Recipe
from runtime.manifest.load import MANIFEST, Manifest, with_files
from runtime.manifest.types import IO, BuiltLimits, BuiltTarget, ModelInfo, PassTiming, Tokens

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")


class BuildError(RuntimeError):
    """The build was refused or failed; no engine directory was written."""


def weight_progress(graph: Graph, log) -> Callable[[str], None]:
    from tqdm import tqdm

    bar = tqdm(total=len(graph.weights), desc="writing weights", unit="tensor", leave=False,
               disable=None)
    return lambda name: bar.update(1)


def copy_tokenizer(model_dir: Path, tmp: Path) -> None:
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


def build_manifest(graph: Graph, params: int, recipe: Recipe, model_dir: Path, io: IO, manager: PassManager,
                   seconds: float) -> Manifest:
    """The engine's manifest: the sections the trace and the passes filled in `graph.meta` (typed as the
    manifest types them), what the recipe asked for, and what the build ran."""
    import onnx
    import onnxruntime

    config_bytes = (model_dir / "config.json").read_bytes()
    config = json.loads(config_bytes)
    meta = graph.meta
    kv = meta.kv_cache
    return as_read(Manifest(
        builder_version=__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        model=ModelInfo(family=meta.family, architecture=meta.architecture, source=str(model_dir.resolve()),
                        config_sha256=hashlib.sha256(config_bytes).hexdigest(), hyperparameters=meta.hyperparameters,
                        num_parameters=params, tokens=_special_tokens(model_dir, config)),
        recipe=recipe.to_dict(),
        target=BuiltTarget(backend=recipe.target.backend, device=recipe.target.device, dtype=recipe.target.dtype,
                           attention=recipe.target.attention,
                           weight_kernels=recipe.target.weight_kernels, onnx_opset=OPSET, contrib_ops=tuple(contrib_ops(graph)),
                           built_with={"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}),
        limits=BuiltLimits(max_batch_size=kv.slots, max_seq_len=kv.max_seq_len,
                           kv_memory_budget_mb=recipe.limits.kv_memory_budget_mb, max_seq_len_cap=meta.max_seq_len_cap),
        kv_cache=kv,
        rope=meta.rope,
        quantization=meta.quantization,
        io=io,
        sampling_head=meta.sampling_head,
        cuda_graphs=meta.cuda_graphs,
        lora=meta.lora,
        passes=tuple(PassTiming(phase=t.phase, name=t.name, seconds=round(t.seconds, 6), disabled=t.disabled)
                     for t in manager.timings),
        build_seconds=round(seconds, 3),
    ))


def contrib_ops(graph: Graph) -> list[str]:
    attention = "GroupQueryAttention" if graph.meta.kv_cache.block_size is None else "PagedAttention"
    ops = [attention, "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"]
    return ops + (["MatMulNBits"] if any(graph.nodes_of("QuantLinear")) else [])


def as_read(manifest: Manifest) -> Manifest:
    """`manifest` as the runtime reads it back from its JSON (so what the builder keeps and writes always
    passes the runtime's checks, in the types the runtime sees)."""
    return Manifest.from_dict(json.loads(manifest.to_json()))


def write_manifest(directory: Path, manifest: Manifest) -> Manifest:
    """Write `manifest` with the hashes of the directory's files; returns what was written."""
    manifest = as_read(with_files(manifest, directory))
    (directory / MANIFEST).write_text(manifest.to_json())
    return manifest
