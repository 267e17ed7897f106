"""Front end: match a Hugging Face checkpoint against its family spec and emit the IR graph.

The HF model skeleton is instantiated on the meta device (no weight memory) only to learn which
parameters exist; anything the spec does not cover is an error. Weights stay lazy references."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from builder.checkpoint_checks import check_checkpoint_files, check_tensors
from builder.ir import Graph, GraphMeta
from builder.spec import ModelSpec, SpecError, spec_for, window_of
from builder.gguf.checkpoint import open_checkpoint  # GGUF-staged or Hugging Face
from builder.trace_moe import expert_source, routed_mlp, stored_sources
from builder.weights import Checkpoint, CheckpointError, WeightSource
from runtime.manifest.types import Rope


def trace(checkpoint_dir: str | Path) -> Graph:
    """Read config.json, pick the family spec, check coverage and build the unfused IR graph."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    check_checkpoint_files(checkpoint_dir)  # config.json, no remote code, tokenizer.json (builder/checkpoint_checks.py)
    checkpoint = open_checkpoint(checkpoint_dir)  # a pre-quantized one reads through builder/quant/imported.py
    config = AutoConfig.from_pretrained(str(checkpoint_dir), local_files_only=True, trust_remote_code=False)
    architecture = _architecture(config)
    spec = spec_for(architecture)
    hp = spec.resolve(config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    names = _match_parameters(spec, hp, architecture, skeleton)
    check_tensors(checkpoint, skeleton, names)  # shapes from the skeleton, dtypes
    graph = Graph(name=f"{spec.family}:{architecture}")
    rope, layer_ropes = _rope_tables(spec, config, skeleton)
    graph.meta = GraphMeta(family=spec.family, architecture=architecture, hyperparameters=hp, rope=rope,
                           layer_ropes=layer_ropes)
    if getattr(checkpoint, "format", None) is not None:  # pre-quantized (QuantizedCheckpoint, GGUFCheckpoint)
        graph.meta.prequantized = checkpoint.format.record()
    weights = _weights(graph, spec, names, checkpoint, stored_sources(spec, hp, names, checkpoint, skeleton))
    _build_decoder(graph, spec, hp, weights)
    return graph


def _architecture(config: Any) -> str:
    """config.json's first `architectures` entry; without one (a checkpoint saved from a GGUF-loaded model),
    the causal-LM class transformers maps its model_type to, as transformers itself falls back."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = getattr(config, "architectures", None)
    if names:
        return names[0]
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, f"<none in config.json for {config.model_type!r}>")


def _match_parameters(spec: ModelSpec, hp: dict, architecture: str, skeleton: Any) -> dict[str, str]:
    """IR weight key -> HF parameter name; every HF parameter must be claimed by the spec."""
    present = {name for name, _ in skeleton.named_parameters(remove_duplicate=False)}
    wanted = {key: (name.rstrip("?"), not name.endswith("?")) for key, name in spec.weights.items()
              if key not in NOT_GLOBAL}
    tied = bool(hp["tie_word_embeddings"])
    wanted["lm_head"] = (spec.weights["lm_head_tied_to"] if tied else spec.weights["lm_head"], True)
    for layer in range(hp["num_layers"]):
        wanted.update({f"layers.{layer}.{k}": v for k, v in spec.layer_weights(layer, hp).items()})
    missing = [hf for hf, required in wanted.values() if required and hf not in present]
    if missing:
        raise SpecError(f"{architecture}: the {spec.family} spec expects parameters the model lacks: {missing[:8]}")
    claimed = {hf for hf, _ in wanted.values()} | ({spec.weights["lm_head"]} if tied else set())
    uncovered = sorted(present - claimed)
    if uncovered:
        raise SpecError(f"{architecture}: parameters not covered by model_specs/{spec.family}.yaml: "
                        f"{uncovered[:12]}{' ...' if len(uncovered) > 12 else ''}")
    return {key: hf for key, (hf, _) in wanted.items() if hf in present}


NOT_GLOBAL = ("lm_head", "lm_head_tied_to", "layer_prefix", "layer")  # other `weights:` keys: model-wide weights
LINEAR_WEIGHTS = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")


def _weights(graph: Graph, spec: ModelSpec, names: dict[str, str], checkpoint: Checkpoint,
             stored: dict[str, WeightSource]) -> dict[str, str]:
    """IR key -> graph weight; `stored`: sources of the MoE weights kept in the hub's form (trace_moe.py)."""
    available = checkpoint.names()
    absent = sorted(hf for key, hf in names.items() if hf not in available and key not in stored)
    if absent:
        raise CheckpointError(f"{checkpoint.path}: checkpoint lacks tensors the model needs: {absent[:8]}")
    by_tensor: dict[str, str] = {}
    offset = float(spec.block["norm_weight_offset"])
    for key, hf in names.items():  # tied embeddings: one weight, used twice
        if hf not in by_tensor:
            source = expert_source(spec, key, hf, stored.get(key) or checkpoint.source(hf))
            stored_out_in = getattr(checkpoint, "stored_out_in", lambda _: False)(hf)  # a GGUF file's GPT-2 linears
            if spec.block["linear_layout"] == "in_out" and key.rsplit(".", 1)[-1] in LINEAR_WEIGHTS and not stored_out_in:
                source = Transposed(source)  # Conv1D stores [in, out]; IR Linear weights are [out, in]
            held = getattr(getattr(checkpoint, "arch", None), "norms_hold_offset", False)  # GGUF Gemma: 1 + w stored
            by_tensor[hf] = graph.add_weight(key, Offset(source, offset) if offset and _is_norm(key) and not held
                                             else source)
    return {key: by_tensor[hf] for key, hf in names.items()}


def _is_norm(key: str) -> bool:
    return key.rsplit(".", 1)[-1].endswith("norm")


@dataclass(eq=False)
class Offset(WeightSource):
    """A norm weight stored as an offset from `offset` (Gemma's RMSNorm scales by 1 + weight), computed in
    float32 the way the HF norm does."""

    part: WeightSource
    offset: float

    def __post_init__(self) -> None:
        self.shape, self.dtype = self.part.shape, "float32"

    def materialize(self) -> np.ndarray:
        return self.part.materialize().astype(np.float32) + np.float32(self.offset)

    def __str__(self) -> str:
        return f"{self.offset:g} + {self.part}"


@dataclass(eq=False)
class Transposed(WeightSource):
    """A 2-D weight stored [in, out] (GPT-2's Conv1D), read as [out, in]."""

    part: WeightSource

    def __post_init__(self) -> None:
        self.shape, self.dtype = tuple(reversed(self.part.shape)), self.part.dtype

    def materialize(self) -> np.ndarray:
        return np.ascontiguousarray(self.part.materialize().T)

    def __str__(self) -> str:
        return f"transpose({self.part})"


def _rope_tables(spec: ModelSpec, config: Any, skeleton: Any) -> tuple[Rope, dict[str, Rope]]:
    """The runtime's rotary table (inv_freq and attention scaling from the model's own rotary module, built
    on CPU) and, for a module with one table per layer type (spec `rotary.by_layer_type`, Gemma 3), the
    other kinds' tables by layer type where they differ from it. Learned positions: type none, and one zero
    frequency so the runtime's (unused) cos/sin inputs keep their shape."""
    import torch

    if spec.block["positions"] == "learned":
        return Rope(type="none", inv_freq=(0.0,), attention_scaling=1.0, interleaved=False), {}

    module = skeleton.get_submodule(spec.rotary["module"])
    with torch.device("cpu"):
        rotary = type(module)(config=config)
    if not spec.rotary.get("by_layer_type"):
        return _rope(spec, config, getattr(rotary, "rope_type", "default"), rotary.inv_freq,
                     rotary.attention_scaling), {}
    tables = {kind: _rope(spec, config, rotary.rope_type[kind], getattr(rotary, f"{kind}_inv_freq"),
                          getattr(rotary, f"{kind}_attention_scaling")) for kind in rotary.layer_types}
    main = tables.pop(spec.rotary["runtime_table"], None) or tables.pop(sorted(tables)[0])
    return main, {kind: rope for kind, rope in tables.items() if rope != main}


def _rope(spec: ModelSpec, config: Any, rope_type: str, inv_freq: Any, attention_scaling: float) -> Rope:
    if rope_type in spec.rotary["unsupported_types"]:
        raise SpecError(f"rope type {rope_type!r} is not supported (its frequencies depend on the sequence "
                        f"length); supported: every other transformers rope type")
    exact_up_to = None
    if rope_type == "longrope":  # the short factors hold up to the original length, then HF switches to long
        exact_up_to = int(config.rope_parameters.get("original_max_position_embeddings")
                          or config.original_max_position_embeddings)
    return Rope(type=rope_type, inv_freq=tuple(float(f) for f in inv_freq.float().numpy().astype(np.float32)),
                attention_scaling=float(attention_scaling), interleaved=spec.rotary["interleaved"],
                exact_up_to=exact_up_to)


def _build_decoder(g: Graph, spec: ModelSpec, hp: dict, w: dict[str, str]) -> None:
    """The pre-norm decoder, written the way the HF modeling code reads; the spec's block features and
    the weights it names (q_norm/k_norm, post-attention/post-feedforward norms, fused qkv or gate_up)
    switch its parts on."""
    b = _Block(g, spec, hp, w)
    hidden, f32 = hp["hidden_size"], "float32"
    ids = g.add_input("input_ids", ACT, "int64")
    index = g.add_input("logits_index", ("num_logits",), "int64")
    scale = float(np.float32(hidden ** 0.5)) if spec.block["embedding_scale"] == "sqrt_hidden" else 1.0
    x = g.make("Embedding", [ids, w["embed"]], ACT + (hidden,), f32, "embed", scale=scale)
    if spec.block["positions"] == "learned":
        positions = g.make("PositionEmbedding", [ids, w["pos_embed"]], ACT + (hidden,), f32, "pos_embed")
        x = g.make("Add", [x, positions], ACT + (hidden,), f32, "embed")
    for layer in range(hp["num_layers"]):
        p = f"layers.{layer}."
        x = g.make("Add", [x, b.post_norm(b.attention(b.norm(x, p + "attn_norm"), layer), p + "post_attn_norm")],
                   ACT + (hidden,), f32, "resid")
        x = g.make("Add", [x, b.post_norm(b.mlp(b.norm(x, p + "mlp_norm"), p), p + "post_mlp_norm")],
                   ACT + (hidden,), f32, "resid")
    x = g.make("GatherTokens", [b.norm(x, "final_norm"), index], ("num_logits", hidden), f32, "last")
    cap = hp.get("final_softcap")
    logits = g.make("Linear", [x, w["lm_head"]], ("num_logits", hp["vocab_size"]), f32,
                    **({} if cap else {"out": "logits"}))
    if cap:
        g.make("SoftCap", [logits], ("num_logits", hp["vocab_size"]), f32, out="logits", cap=float(cap))
    g.add_output("logits")


ACT = ("batch", "seq")


@dataclass
class _Block:
    """The parts of one decoder layer; each returns the name of its output value [b, s, features]."""

    g: Graph
    spec: ModelSpec
    hp: dict
    w: dict[str, str]

    def linear(self, inp: str, key: str, out: int) -> str:
        bias = self.w.get(f"{key}_bias", "")
        return self.g.make("Linear", [inp, self.w[key]] + ([bias] if bias else []), ACT + (out,), "float32",
                           key.split(".")[-1])

    def norm(self, inp: str, key: str) -> str:  # x [b, s, hidden]
        shape, eps, hint = ACT + (self.hp["hidden_size"],), self.hp["norm_eps"], key.split(".")[-1]
        if self.spec.block["norm"] == "layer":
            return self.g.make("LayerNorm", [inp, self.w[key], self.w[key + "_bias"]], shape, "float32", hint,
                               eps=eps)
        return self.g.make("RMSNorm", [inp, self.w[key]], shape, "float32", hint, eps=eps)

    def post_norm(self, inp: str, key: str) -> str:
        return self.norm(inp, key) if key in self.w else inp

    def head_norm(self, inp: str, key: str, heads: int) -> str:  # x [b, s, heads * dim], norm per head
        if key not in self.w:
            return inp
        dim = self.hp["head_dim"]
        return self.g.make("HeadRMSNorm", [inp, self.w[key]], ACT + (heads * dim,), "float32", key.split(".")[-1],
                           eps=self.hp["norm_eps"], head_dim=dim)

    def attention(self, h: str, layer: int) -> str:
        """Projections, attention and the output projection of one layer."""
        g, hp, p = self.g, self.hp, f"layers.{layer}."
        heads, kv_heads, dim = hp["num_heads"], hp["num_kv_heads"], hp["head_dim"]
        out = ACT + (heads * dim,)
        options = dict(layer=layer, num_heads=heads, kv_heads=kv_heads, head_dim=dim, window=window_of(hp, layer),
                       softcap=float(hp.get("attn_softcap") or 0.0), scale=_attention_scale(hp))
        if p + "qkv" in self.w:  # fused in the checkpoint (Phi-3, GPT-2): [q | k | v] goes to the kernel as stored
            qkv = self.linear(h, p + "qkv", (heads + 2 * kv_heads) * dim)
            a = g.make("Attention", [qkv, "", ""], out, "float32", "attn", packed_qkv=True,
                       rotary=self.spec.block["positions"] == "rotary", **options, **self.rope_table(layer))
        else:
            q = self.head_norm(self.linear(h, p + "q", heads * dim), p + "q_norm", heads)
            k = self.head_norm(self.linear(h, p + "k", kv_heads * dim), p + "k_norm", kv_heads)
            v = self.linear(h, p + "v", kv_heads * dim)
            table = self.rope_table(layer)
            q = g.make("Rotary", [q], out, "float32", "q_rot", num_heads=heads, head_dim=dim, **table)
            k = g.make("Rotary", [k], ACT + (kv_heads * dim,), "float32", "k_rot", num_heads=kv_heads, head_dim=dim,
                       **table)
            sinks = [self.w[p + "sinks"]] if p + "sinks" in self.w else []  # gpt-oss
            a = g.make("Attention", [q, k, v] + sinks, out, "float32", "attn", rotary=False, packed_qkv=False,
                       **options)
        return self.linear(a, p + "o", hp["hidden_size"])

    def rope_table(self, layer: int) -> dict[str, str]:
        """`table=<layer type>` where this layer's kind has its own rotary table (graph.meta.layer_ropes),
        else nothing: the runtime's table."""
        types = self.hp.get("layer_types")
        kind = types[layer] if types else None
        return {"table": kind} if kind in self.g.meta.layer_ropes else {}

    def mlp(self, h: str, p: str) -> str:
        """Routed experts (a sparse layer of a mixture-of-experts family, builder/trace_moe.py), a gated
        (act(gate) * up, or one fused gate_up) or a plain (act(up)) MLP, then down."""
        g, inter, fn = self.g, self.hp["intermediate_size"], self.hp["activation"]
        if p + "router" in self.w:
            return routed_mlp(self, h, p)
        if self.spec.block["mlp"] == "plain":
            m = g.make("Activation", [self.linear(h, p + "up", inter)], ACT + (inter,), "float32", "act", fn=fn)
            return self.linear(m, p + "down", self.hp["hidden_size"])
        return self.gated_mlp(h, p, inter)

    def gated_mlp(self, h: str, p: str, inter: int) -> str:
        g, fn = self.g, self.hp["activation"]
        if p + "gate_up" in self.w:  # fused in the checkpoint (Phi-3): [gate | up]
            m = g.make("GatedActivation", [self.linear(h, p + "gate_up", 2 * inter)], ACT + (inter,), "float32",
                       "gated", fn=fn)
        else:
            gate = g.make("Activation", [self.linear(h, p + "gate", inter)], ACT + (inter,), "float32", "act", fn=fn)
            m = g.make("Mul", [gate, self.linear(h, p + "up", inter)], ACT + (inter,), "float32", "gated")
        return self.linear(m, p + "down", self.hp["hidden_size"])


def _attention_scale(hp: dict) -> float:
    """The softmax scale: 1/sqrt(query_pre_attn_scalar) where the config sets one (Gemma-2), else 1/sqrt(head_dim)."""
    if hp.get("scale_attn_weights") is False:  # GPT-2 configs may switch the scaling off
        return 1.0
    return float(hp.get("query_pre_attn_scalar") or hp["head_dim"]) ** -0.5
