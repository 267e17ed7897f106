"""Importance scores from calibration text (Minitron, Muralidharan et al. 2024): activation-based, one forward
pass of the teacher per batch, no gradients.

- depth, "block": 1 - cos(input, output) of each decoder layer, averaged over tokens (a layer that barely turns
  the residual stream is cheap to drop);
- depth, "perplexity": the increase of the calibration loss when that one layer is skipped (and, to check the
  head scores against, `head_perplexity_scores`: the increase when one KV group's heads are silenced);
- heads: mean L2 norm of each attention head's output (the o_proj input), summed over the heads of a KV group;
- ffn: mean |activation| of each MLP channel (the down_proj input);
- hidden: mean |value| of each channel at the outputs of every RMSNorm (the LayerNorm-output importance)."""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from builder.compress.data import batches


@dataclass
class Scores:
    """Per-unit importance (higher: more important). layers: [L]; heads: [L, kv_groups]; ffn: [L, intermediate];
    hidden: [hidden_size]."""

    layers_block: torch.Tensor
    heads: torch.Tensor
    ffn: torch.Tensor
    hidden: torch.Tensor
    layers_perplexity: torch.Tensor | None = None


def lm_loss(model, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of `rows` [batch, seq + 1] (fp32)."""
    logits = model(input_ids=rows[:, :-1], use_cache=False).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))


@contextlib.contextmanager
def _hooks(model, acc: dict):
    layers = model.model.layers
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    handles = []

    def on_block(i):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            cos = F.cosine_similarity(x.float(), output.float(), dim=-1)  # [batch, seq]
            acc["block"][i] += (1 - cos).sum().item()
        return hook

    def on_heads(i):
        def hook(module, args):
            x = args[0].float()  # [batch, seq, heads * head_dim]
            norms = x.reshape(*x.shape[:2], cfg.num_attention_heads, -1).norm(dim=-1)  # [batch, seq, heads]
            acc["heads"][i] += norms.sum((0, 1)).reshape(-1, group).sum(-1)
        return hook

    def on_ffn(i):
        def hook(module, args):
            acc["ffn"][i] += args[0].float().abs().sum((0, 1))
        return hook

    def on_norm(module, args, output):
        acc["hidden"] += output.float().abs().sum((0, 1))

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(on_block(i), with_kwargs=True))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(on_heads(i)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(on_ffn(i)))
        handles += [layer.input_layernorm.register_forward_hook(on_norm),
                    layer.post_attention_layernorm.register_forward_hook(on_norm)]
    handles.append(model.model.norm.register_forward_hook(on_norm))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def activation_scores(model, rows: torch.Tensor, batch_size: int = 8) -> Scores:
    """Block, head-group, MLP-channel and hidden-channel importance of `model` on calibration `rows`."""
    cfg = model.config
    n_layers = len(model.model.layers)
    device = next(model.parameters()).device
    acc = {"block": [0.0] * n_layers,
           "heads": torch.zeros(n_layers, cfg.num_key_value_heads, device=device),
           "ffn": torch.zeros(n_layers, cfg.intermediate_size, device=device),
           "hidden": torch.zeros(cfg.hidden_size, device=device)}
    tokens = 0
    with _hooks(model, acc):
        for batch in batches(rows, batch_size):
            model(input_ids=batch[:, :-1], use_cache=False)
            tokens += batch[:, :-1].numel()
    return Scores(layers_block=torch.tensor(acc["block"]) / tokens, heads=acc["heads"].cpu() / tokens,
                  ffn=acc["ffn"].cpu() / tokens, hidden=acc["hidden"].cpu() / tokens)


@contextlib.contextmanager
def skipping(model, layer: int):
    """Within the block, `model` runs without decoder layer `layer`."""
    kept = model.model.layers
    model.model.layers = torch.nn.ModuleList(m for i, m in enumerate(kept) if i != layer)
    try:
        yield model
    finally:
        model.model.layers = kept


@torch.no_grad()
def calibration_loss(model, rows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy over `rows`, weighted by batch size."""
    total = sum(lm_loss(model, b).item() * b.shape[0] for b in batches(rows, batch_size))
    return total / rows.shape[0]


@torch.no_grad()
def perplexity_scores(model, rows: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """[L]: the calibration loss increase (log-perplexity) when each decoder layer alone is skipped."""
    base = calibration_loss(model, rows, batch_size)
    costs = []
    for layer in range(len(model.model.layers)):
        with skipping(model, layer):
            costs.append(calibration_loss(model, rows, batch_size) - base)
    return torch.tensor(costs)


def head_size(config) -> int:
    """A transformers config's head size: its head_dim where it has one (Qwen3, Gemma), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@contextlib.contextmanager
def silencing(model, layer: int, group: int):
    """Within the block, the heads of KV group `group` of decoder layer `layer` write nothing (their o_proj inputs
    are zero): what pruning that group leaves of the layer."""
    cfg = model.config
    width = cfg.num_attention_heads // cfg.num_key_value_heads * head_size(cfg)

    def hook(module, args):
        x = args[0].clone()
        x[..., group * width:(group + 1) * width] = 0
        return (x, *args[1:])

    handle = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@torch.no_grad()
def head_perplexity_scores(model, rows: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """[L, kv_groups]: the loss increase (log-perplexity) on `rows` when each KV group's heads alone are silenced."""
    base = calibration_loss(model, rows, batch_size)
    costs = torch.zeros(len(model.model.layers), model.config.num_key_value_heads)
    for layer, group in itertools.product(*map(range, costs.shape)):
        with silencing(model, layer, group):
            costs[layer, group] = calibration_loss(model, rows, batch_size) - base
    return costs
