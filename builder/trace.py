"""Front end: match a Hugging Face checkpoint against its family spec and emit the IR graph.

The HF model skeleton is instantiated on the meta device (no weight memory) only to learn which
parameters exist; anything the spec does not cover is an error. Weights stay lazy references."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from builder.checkpoint_checks import check_checkpoint_files, check_tensors
from builder.ir import Graph
from builder.spec import ModelSpec, SpecError, spec_for
from builder.weights import Checkpoint, CheckpointError, CheckpointTensor


def trace(checkpoint_dir: str | Path) -> Graph:
    """Read config.json, pick the family spec, check coverage and build the unfused IR graph."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    check_checkpoint_files(checkpoint_dir)  # config.json, no remote code, tokenizer.json (builder/checkpoint_checks.py)
    checkpoint = Checkpoint(checkpoint_dir)
    config = AutoConfig.from_pretrained(str(checkpoint_dir), local_files_only=True, trust_remote_code=False)
    architecture = (getattr(config, "architectures", None) or ["<none in config.json>"])[0]
    spec = spec_for(architecture)
    hp = spec.resolve(config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    names = _match_parameters(spec, hp, architecture, skeleton)
    check_tensors(checkpoint, skeleton, names)  # shapes from the skeleton, dtypes
    graph = Graph(name=f"{spec.family}:{architecture}")
    graph.meta.update(family=spec.family, architecture=architecture, hyperparameters=hp,
                      rope=_rope_tables(spec, config, skeleton))
    weights = _weights(graph, spec, hp, names, checkpoint)
    _build_decoder(graph, hp, weights)
    return graph


def _match_parameters(spec: ModelSpec, hp: dict, architecture: str, skeleton: Any) -> dict[str, str]:
    """IR weight key -> HF parameter name; every HF parameter must be claimed by the spec."""
    present = {name for name, _ in skeleton.named_parameters(remove_duplicate=False)}
    wanted = {"embed": (spec.weights["embed"], True), "final_norm": (spec.weights["final_norm"], True)}
    tied = bool(hp["tie_word_embeddings"])
    wanted["lm_head"] = (spec.weights["lm_head_tied_to"] if tied else spec.weights["lm_head"], True)
    for layer in range(hp["num_layers"]):
        wanted.update({f"layers.{layer}.{k}": v for k, v in spec.layer_weights(layer).items()})
    missing = [hf for hf, required in wanted.values() if required and hf not in present]
    if missing:
        raise SpecError(f"{architecture}: the {spec.family} spec expects parameters the model lacks: {missing[:8]}")
    claimed = {hf for hf, _ in wanted.values()} | ({spec.weights["lm_head"]} if tied else set())
    uncovered = sorted(present - claimed)
    if uncovered:
        raise SpecError(f"{architecture}: parameters not covered by model_specs/{spec.family}.yaml: "
                        f"{uncovered[:12]}{' ...' if len(uncovered) > 12 else ''}")
    return {key: hf for key, (hf, _) in wanted.items() if hf in present}


def _weights(graph: Graph, spec: ModelSpec, hp: dict, names: dict[str, str],
             checkpoint: Checkpoint) -> dict[str, str]:
    available = checkpoint.names()
    absent = sorted(hf for hf in names.values() if hf not in available)
    if absent:
        raise CheckpointError(f"{checkpoint.path}: checkpoint lacks tensors the model needs: {absent[:8]}")
    by_tensor: dict[str, str] = {}
    for key, hf in names.items():  # tied embeddings: one weight, used twice
        if hf not in by_tensor:
            by_tensor[hf] = graph.add_weight(key, CheckpointTensor(checkpoint, hf))
    return {key: by_tensor[hf] for key, hf in names.items()}


def _rope_tables(spec: ModelSpec, config: Any, skeleton: Any) -> dict[str, Any]:
    """inv_freq and attention scaling from the model's own rotary module, built on CPU."""
    import torch

    module = skeleton.get_submodule(spec.rotary["module"])
    with torch.device("cpu"):
        rotary = type(module)(config=config)
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type in spec.rotary["unsupported_types"]:
        raise SpecError(f"rope type {rope_type!r} is not supported (its frequencies depend on the sequence "
                        f"length); supported: every other transformers rope type")
    inv_freq = rotary.inv_freq.float().numpy().astype(np.float32)
    return {"type": rope_type, "inv_freq": [float(f) for f in inv_freq],
            "attention_scaling": float(rotary.attention_scaling), "interleaved": spec.rotary["interleaved"]}


def _build_decoder(g: Graph, hp: dict, w: dict[str, str]) -> None:
    """The pre-norm decoder block, written the way the HF modeling code reads."""
    hidden, heads, kv_heads, dim = hp["hidden_size"], hp["num_heads"], hp["num_kv_heads"], hp["head_dim"]
    eps, f32 = hp["norm_eps"], "float32"
    act = ("batch", "seq")
    ids = g.add_input("input_ids", act, "int64")
    index = g.add_input("logits_index", ("num_logits",), "int64")
    x = g.make("Embedding", [ids, w["embed"]], act + (hidden,), f32, "embed")

    def linear(inp: str, key: str, out: int) -> str:
        bias = w.get(f"{key}_bias", "")
        return g.make("Linear", [inp, w[key]] + ([bias] if bias else []), act + (out,), f32, key.split(".")[-1])

    for layer in range(hp["num_layers"]):
        p = f"layers.{layer}."
        h = g.make("RMSNorm", [x, w[p + "attn_norm"]], act + (hidden,), f32, "attn_norm", eps=eps)
        q = linear(h, p + "q", heads * dim)
        k = linear(h, p + "k", kv_heads * dim)
        v = linear(h, p + "v", kv_heads * dim)
        q = g.make("Rotary", [q], act + (heads * dim,), f32, "q_rot", num_heads=heads, head_dim=dim)
        k = g.make("Rotary", [k], act + (kv_heads * dim,), f32, "k_rot", num_heads=kv_heads, head_dim=dim)
        a = g.make("Attention", [q, k, v], act + (heads * dim,), f32, "attn", layer=layer,
                   num_heads=heads, kv_heads=kv_heads, head_dim=dim, rotary=False, packed_qkv=False)
        x = g.make("Add", [x, linear(a, p + "o", hidden)], act + (hidden,), f32, "resid")
        h = g.make("RMSNorm", [x, w[p + "mlp_norm"]], act + (hidden,), f32, "mlp_norm", eps=eps)
        inter = hp["intermediate_size"]
        gate = g.make("Activation", [linear(h, p + "gate", inter)], act + (inter,), f32, "act",
                      fn=hp["activation"])
        m = g.make("Mul", [gate, linear(h, p + "up", inter)], act + (inter,), f32, "gated")
        x = g.make("Add", [x, linear(m, p + "down", hidden)], act + (hidden,), f32, "resid")
    x = g.make("RMSNorm", [x, w["final_norm"]], act + (hidden,), f32, "final_norm", eps=eps)
    x = g.make("GatherTokens", [x, index], ("num_logits", hidden), f32, "last")
    g.make("Linear", [x, w["lm_head"]], ("num_logits", hp["vocab_size"]), f32, out="logits")
    g.add_output("logits")
