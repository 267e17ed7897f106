"""Structured pruning: choose the units to keep from importance scores, then build the smaller Llama-family model
by slicing the teacher's weights (the pruned model computes what the teacher computes with the other units'
contributions zeroed: heads' o_proj columns, MLP channels' down_proj columns, whole layers, hidden channels)."""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch

from builder.compress.importance import Scores, head_size
from builder.compress.plan import PrunePlan


@dataclass
class Selection:
    """The units the student keeps, as teacher indices in ascending order: layers [kept]; kv_groups and ffn one
    list per teacher layer; hidden [kept]. `scores` holds the importance each choice was made from."""

    layers: list[int]
    kv_groups: list[list[int]]
    ffn: list[list[int]]
    hidden: list[int]
    scores: dict

    def to_json(self) -> dict:
        return asdict(self)


def _top(scores: torch.Tensor, keep: int) -> list[int]:
    return sorted(torch.topk(scores, keep).indices.tolist())


def choose(plan: PrunePlan, scores: Scores, config) -> Selection:
    """The units with the highest importance, as many as the plan keeps (every unit where it keeps all)."""
    depth = scores.layers_perplexity if plan.depth_metric == "perplexity" else scores.layers_block
    n_layers, kv = config.num_hidden_layers, config.num_key_value_heads
    group = config.num_attention_heads // kv
    return Selection(
        layers=_top(depth, plan.layers or n_layers),
        kv_groups=[_top(s, (plan.heads or config.num_attention_heads) // group) for s in scores.heads],
        ffn=[_top(s, plan.ffn or config.intermediate_size) for s in scores.ffn],
        hidden=_top(scores.hidden, plan.hidden or config.hidden_size),
        scores={"layers_block": scores.layers_block.tolist(), "heads": scores.heads.tolist(),
                "ffn": scores.ffn.tolist(), "hidden": scores.hidden.tolist(),
                "layers_perplexity": None if scores.layers_perplexity is None else scores.layers_perplexity.tolist()},
    )


def pruned_config(config, sel: Selection):
    """The teacher's config with the kept sizes. With hidden channels removed, RMSNorm's epsilon is scaled so the
    norms compute over the kept channels what the teacher computes with the others zeroed (weights: _norm)."""
    out = copy.deepcopy(config)
    group = config.num_attention_heads // config.num_key_value_heads
    out.head_dim = head_size(config)
    out.num_hidden_layers = len(sel.layers)
    out.num_key_value_heads = len(sel.kv_groups[0])
    out.num_attention_heads = len(sel.kv_groups[0]) * group
    out.intermediate_size = len(sel.ffn[0])
    out.hidden_size = len(sel.hidden)
    out.rms_norm_eps = config.rms_norm_eps * config.hidden_size / len(sel.hidden)
    if getattr(config, "layer_types", None):
        out.layer_types = [config.layer_types[i] for i in sel.layers]
    return out


def _linear(dst: torch.nn.Linear, src: torch.nn.Linear, rows: torch.Tensor, cols: torch.Tensor) -> None:
    dst.weight.copy_(src.weight[rows][:, cols])
    if src.bias is not None:
        dst.bias.copy_(src.bias[rows])


def _norm(dst, src, hidden: torch.Tensor, full: int) -> None:
    dst.weight.copy_(src.weight[hidden] * (full / hidden.numel()) ** 0.5)


def _head_rows(groups: list[int], per_group: int, head_dim: int) -> torch.Tensor:
    heads = [g * per_group + j for g in groups for j in range(per_group)]
    return torch.tensor([h * head_dim + d for h in heads for d in range(head_dim)])


@torch.no_grad()
def prune(model, sel: Selection):
    """A new model of the teacher's class with only the selected units, weights sliced from `model`'s."""
    cfg = model.config
    new = type(model)(pruned_config(cfg, sel)).to(model.dtype).eval()
    head_dim, group = new.config.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    hidden = torch.tensor(sel.hidden)
    new.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[:, hidden])
    if not cfg.tie_word_embeddings:
        new.lm_head.weight.copy_(model.lm_head.weight[:, hidden])
    _norm(new.model.norm, model.model.norm, hidden, cfg.hidden_size)
    for dst, i in zip(new.model.layers, sel.layers):
        src = model.model.layers[i]
        q = _head_rows(sel.kv_groups[i], group, head_dim)
        kv = _head_rows(sel.kv_groups[i], 1, head_dim)
        ffn = torch.tensor(sel.ffn[i])
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            _linear(getattr(dst.self_attn, name), getattr(src.self_attn, name), rows, hidden)
        _linear(dst.self_attn.o_proj, src.self_attn.o_proj, hidden, q)
        _linear(dst.mlp.gate_proj, src.mlp.gate_proj, ffn, hidden)
        _linear(dst.mlp.up_proj, src.mlp.up_proj, ffn, hidden)
        _linear(dst.mlp.down_proj, src.mlp.down_proj, hidden, ffn)
        _norm(dst.input_layernorm, src.input_layernorm, hidden, cfg.hidden_size)
        _norm(dst.post_attention_layernorm, src.post_attention_layernorm, hidden, cfg.hidden_size)
    if getattr(model, "generation_config", None) is not None:
        new.generation_config = copy.deepcopy(model.generation_config)
    return new
