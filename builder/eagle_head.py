"""Build an EAGLE draft head (engine-compress --eagle, builder/compress/eagle.py) into `<engine>/draft`: a small
engine of its own, one decoder layer of the target's family with its own one-layer KV cache, traced into the IR by
the trace's own block (builder/trace.py `_Block`) and run through the same pipeline and lowering as any engine.

The head's graph, for tokens x [batch, seq] (x_{t+1}) and the target's features `hidden_in` [batch, seq, hidden] (f_t):

    embed'(x) + hidden_in @ W_h^T  ->  decoder layer  ->  final norm  ->  hidden_states [num_logits, hidden] (f^_{t+1})
                                                                      ->  lm_head_K  ->  logits [num_logits, K]

where fc([embed(x), f]) = embed(x) @ W_e^T + f @ W_h^T + b is folded into the table embed' = embed @ W_e^T + b
(computed here once: a Gather at run time). The runtime reads HEAD_MANIFEST (the head's KV layout, rope, draft
vocabulary, and what it was trained for) and DRAFT_IDS (draft index -> token id)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from builder.compress.eagle import HEAD_FILE, KIND, WEIGHTS_FILE, read_record, tokenizer_hash
from builder.engine_dir import BuildError
from builder.ir import Graph, GraphMeta
from builder.lower_onnx import lower_to_onnx
from builder.pass_manager import PassManager
from builder.pipeline import pipeline
from builder.recipe import Recipe
from builder.spec import spec_for
from builder.trace import ACT, _Block
from builder.weights import ArrayWeight
from runtime.manifest.load import Manifest
from runtime.manifest.types import Speculative, to_json
from runtime.speculation.eagle import DRAFT_IDS, HEAD_MANIFEST, head_mismatch


def build_eagle_head(head_dir: Path, out: Path, recipe: Recipe, target: Manifest, target_dir: Path, log) -> Speculative:
    """Check the head against the target just built (in `target_dir`, its manifest `target`), then trace, run the
    draft recipe's pipeline on and lower the head into `out`; returns the target manifest's record of it."""
    record = read_record(head_dir)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(target_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    if problem := head_mismatch(record, target, tokenizer_hash(vocab)):
        raise BuildError(f"speculative.draft_model {head_dir}: {problem}")
    draft = _head_recipe(recipe)
    from safetensors.numpy import load_file

    weights = load_file(str(head_dir / WEIGHTS_FILE))
    graph = head_graph(weights, target)
    manager = PassManager(pipeline(draft))
    lowered = manager.run(graph)
    log(f"EAGLE head: {len(lowered.nodes)} nodes, draft vocabulary {len(weights['draft_ids'])}, quantization "
        f"{draft.quantization.mode}")
    out.mkdir(parents=True, exist_ok=True)
    io = lower_to_onnx(lowered, out / "model.onnx", draft.target.dtype)
    np.save(out / DRAFT_IDS, weights["draft_ids"].astype(np.int64))
    trained = {k: record[k] for k in ("architecture", "hidden_size", "num_layers", "vocab_size", "tokenizer_sha256")}
    head = {"kind": KIND, **trained, "draft_vocab": int(len(weights["draft_ids"])),
            "kv_cache": to_json(lowered.meta.kv_cache), "rope": to_json(target.rope),
            "quantization": draft.quantization.mode, "io": to_json(io), "source": str(head_dir),
            "heldout": record.get("heldout"), "coverage_heldout": record.get("coverage_heldout")}
    (out / HEAD_MANIFEST).write_text(json.dumps(head, indent=1) + "\n")
    return Speculative(draft_dir=out.name, draft_model=str(head_dir), draft_quantization=draft.quantization.mode,
                       num_draft_tokens=recipe.speculative.num_draft_tokens, kind=KIND)


def _head_recipe(recipe: Recipe) -> Recipe:
    """The head's recipe: the target's limits and device, the draft quantization (weights only: no calibrated
    AWQ/GPTQ, float KV), no sampling head, LoRA or CUDA graphs."""
    draft = recipe.draft_recipe()
    if draft.quantization.mode != "none" and draft.quantization.mode.startswith(("awq", "gptq")):
        raise BuildError(f"speculative.draft_quantization {draft.quantization.mode}: an EAGLE head is quantized "
                         f"without calibration; use none, int8 or int4_rtn")
    return dataclasses.replace(draft, sampling_head=dataclasses.replace(draft.sampling_head, enabled=False),
                               kv_cache=dataclasses.replace(draft.kv_cache, dtype="float"),
                               cuda_graphs=dataclasses.replace(draft.cuda_graphs, enabled=False))


def head_graph(weights: dict[str, np.ndarray], target: Manifest) -> Graph:
    """The head's IR graph (module docstring) from its trained weights (EagleHead's state dict)."""
    spec = spec_for(target.model.architecture)
    hp = dict(target.model.hyperparameters, num_layers=1, layer_types=None)
    hidden, f32 = hp["hidden_size"], "float32"
    g = Graph(name=f"{spec.family}:eagle_head")
    g.meta = GraphMeta(family=spec.family, architecture=target.model.architecture, hyperparameters=hp,
                       rope=target.rope)
    fc_w, fc_b = weights["fc.weight"], weights["fc.bias"]
    table = weights["embed.weight"] @ fc_w[:, :hidden].T + fc_b  # [vocab, hidden]: fc's embedding half, folded
    add = lambda key, array: g.add_weight(key, ArrayWeight(np.ascontiguousarray(array, np.float32), key))
    w = {f"layers.0.{key}": add(f"layers.0.{key}", weights["layer." + hf.split(".", 3)[3]])
         for key, (hf, _) in spec.layer_weights(0, hp).items() if "layer." + hf.split(".", 3)[3] in weights}
    w["final_norm"] = add("final_norm", weights["norm.weight"])
    b = _Block(g, spec, hp, w)
    ids = g.add_input("input_ids", ACT, "int64")
    features = g.add_input("hidden_in", ACT + (hidden,), f32)
    index = g.add_input("logits_index", ("num_logits",), "int64")
    x = g.make("Embedding", [ids, add("embed", table)], ACT + (hidden,), f32, "embed")
    fed = g.make("Linear", [features, add("fc_hidden", fc_w[:, hidden:])], ACT + (hidden,), f32, "fc")
    x = g.make("Add", [x, fed], ACT + (hidden,), f32, "fc_sum")
    x = g.make("Add", [x, b.post_norm(b.attention(b.norm(x, "layers.0.attn_norm"), 0), "layers.0.post_attn_norm")],
               ACT + (hidden,), f32, "resid")
    x = g.make("Add", [x, b.post_norm(b.mlp(b.norm(x, "layers.0.mlp_norm"), "layers.0."), "layers.0.post_mlp_norm")],
               ACT + (hidden,), f32, "resid")
    f = g.make("GatherTokens", [b.norm(x, "final_norm"), index], ("num_logits", hidden), f32, out="hidden_states")
    k = len(weights["draft_ids"])
    g.make("Linear", [f, add("lm_head", weights["lm_head.weight"])], ("num_logits", k), f32, out="logits")
    g.add_output("logits")
    g.add_output("hidden_states")
    return g
