"""SearchAWQScales: activation-aware scales for the linears QuantizeWeights will quantize to int4.

For each value x read only by Linear nodes (a fold site), the per-input-channel scale s is searched
on calibration inputs (builder/quant/awq.py); the linears' weights become W * s (columns) and 1/s is
folded, exactly, into what produces x, so the graph gains no op and its float function is unchanged:

    RMSNorm / SkipRMSNorm output  -> the norm weight
    GatedActivation(gate_up)      -> the `up` rows of gate_up (and its bias): silu(g) * (u / s)
    Mul(act(gate), up)            -> the up Linear's rows (and bias)
    Attention output (o_proj)     -> the `v` rows of qkv (or of v): GQA shares a v channel among the
                                     query heads of one kv head, so s is tied across them (HeadTie)

A site whose producer is anything else, or whose linears are not all quantized, is left alone and
recorded in graph.meta.awq["skipped"]. Then, once every scale is folded, each site linear's blocks are clipped
(builder/quant/awq.py search_clip) on the site's inputs as the linears now read them (x / s). Weights are
wrapped in lazy ScaledWeight and ClippedWeight sources.

Memory: the calibration run holds the float32 transformers model and <= 512 input rows per site
(builder/quant/calibration.py); the search then holds one site's weights at a time (e.g. gate_up) plus two
fake-quantized copies of them, 20 times over the alpha grid (time, not memory)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from builder.ir import Graph, Node
from builder.ops import PER_HEAD
from builder.pass_manager import Pass
from builder.quant import (SEQ_LEN, CalibrationError, ClippedWeight, HeadTie, QuantOptions, ScaledWeight,
                           calibration_sequences, capture_inputs, checkpoint_key, plan_quantization, search_scales)
from builder.quant.calibration import Calibration
from builder.quant.awq import search_clip


@dataclass
class FoldSite:
    """Linears reading `input`, and the rows (weight, first row) that produce it."""

    input: str
    linears: list[str]
    targets: list[tuple[str, int]]
    tie: HeadTie | None = None


Capture = Callable[[Graph, list[FoldSite], dict[str, int]], dict[str, Calibration]]


class SearchAWQScales(Pass):
    """AWQ scale search and folding. `capture(graph, sites, blocks)` returns each site input's Calibration (sampled
    rows, and the Gram in blocks of blocks[input] over every row); the default runs transformers on the
    calibration text (builder/quant/calibration.py)."""

    name = "search_awq_scales"

    def __init__(self, model_dir: str | Path, options: QuantOptions, capture: Capture | None = None):
        self.model_dir, self.options = Path(model_dir), options
        self.capture = capture or self._capture_with_transformers

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        mapping = plan_quantization(g, self.options)
        sites, skipped = find_sites(g, lambda w: w in mapping.targets)
        blocks = {site.input: mapping.targets[site.linears[0]].block for site in sites}
        inputs = self.capture(g, sites, blocks) if sites else {}
        record, grams = [], {}
        for site in sites:
            target = mapping.targets[site.linears[0]]
            w = np.concatenate([g.weights[name].materialize() for name in site.linears])  # [sum N, K]
            result = search_scales(inputs[site.input].rows, w, target.scheme.bits, target.block,
                                   target.scheme.symmetric, site.tie)
            if result.alpha > 0:  # alpha 0 is s = 1: plain RTN was best, nothing to fold
                fold(g, site, result.scale)
            grams[site.input] = scaled_gram(inputs[site.input].gram, result.scale)  # of x / s, what the linears read
            record.append({"linears": site.linears, "fold_into": [t for t, _ in site.targets],
                           "alpha": result.alpha, "mse_rtn": result.mse_rtn, "mse_awq": result.mse})
        for site, entry in zip(sites, record):  # after every fold: a later site may scale rows of these weights
            entry["clip"] = {name: clip(g, name, grams[site.input], mapping.targets[name]) for name in site.linears}
        g.meta.awq = {"calibration": str(self.options.calibration or "builtin"), "sites": record,
                         "skipped": skipped}
        return g

    def _capture_with_transformers(self, g: Graph, sites: list[FoldSite],
                                   blocks: dict[str, int]) -> dict[str, Calibration]:
        modules = {}
        for site in sites:
            key = checkpoint_key(g.weights[site.linears[0]])
            if key is None or not key.endswith(".weight"):
                raise CalibrationError(f"{site.linears[0]}: not a checkpoint weight; cannot find its module")
            modules[site.input] = key[:-len(".weight")]
        seq_len = min(SEQ_LEN, g.meta.hyperparameters.get("max_position_embeddings") or SEQ_LEN)
        sequences = calibration_sequences(self.model_dir, self.options.calibration, seq_len)
        captured = capture_inputs(self.model_dir, {module: blocks[value] for value, module in modules.items()}, sequences)
        return {value: captured[module] for value, module in modules.items()}


def scaled_gram(gram: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The block Gram matrices of x / s from those of x: entry (i, j) of a block divided by s_i s_j."""
    blocks, block, _ = gram.shape
    s = np.ones(blocks * block, np.float32)
    s[:len(scale)] = scale
    s = s.reshape(blocks, block)
    return gram / (s[:, :, None] * s[:, None, :])


def clip(g: Graph, name: str, gram: np.ndarray, target) -> dict[str, float]:
    """Clamp each block of the weight's rows to the bound that quantizes best on the calibration inputs (AWQ's
    clipping), but for rows that make queries or keys."""
    keep = query_key_rows(g, name)
    result = search_clip(gram, g.weights[name].materialize(), target.scheme.bits, target.block,
                         target.scheme.symmetric, unclipped_rows=keep)
    g.weights[name] = ClippedWeight(g.weights[name], result.bound, target.block)
    return {"error_rtn": result.error_rtn, "error": result.error, "unclipped_rows": keep}


def query_key_rows(g: Graph, name: str) -> int:
    """How many leading rows of the Linear weight `name` make attention queries or keys: a packed qkv's q and k
    rows, all rows of a q or k projection (through its head norm and rotary), the q and k parts of a fused q/k/v
    cut by a Split (fuse_qkv), none otherwise."""
    users = g.consumers()
    linear = next(n for n in users[name] if n.op == "Linear")
    value = linear.outputs[0]
    if [n.op for n in users.get(value, [])] == ["Split"]:
        split, rows = users[value][0], 0
        for part, size in zip(split.outputs, split.attrs["sizes"]):
            if _query_key_rows(part, size, users) < size:
                break
            rows += size
        return rows
    return _query_key_rows(value, g.weights[name].shape[0], users)


def _query_key_rows(value: str, width: int, users) -> int:
    """Of `value` (`width` wide), how many leading channels become attention queries or keys."""
    while len(users.get(value, [])) == 1 and users[value][0].op in PER_HEAD:
        value = users[value][0].outputs[0]
    for attn in (n for n in users.get(value, []) if n.op == "Attention"):
        if attn.attrs["packed_qkv"]:
            return (attn.attrs["num_heads"] + attn.attrs["kv_heads"]) * attn.attrs["head_dim"]
        if value in attn.inputs[:2]:
            return width
    return 0


def find_sites(g: Graph, quantized: Callable[[str], bool]) -> tuple[list[FoldSite], dict[str, str]]:
    """Fold sites in graph order, and why other linear inputs are not sites."""
    producers, users = g.producers(), g.consumers()
    sites, skipped = [], {}
    for value, readers in users.items():
        if not any(n.op == "Linear" and n.inputs[0] == value for n in readers):
            continue
        reason, site = _site(g, value, readers, producers, users, quantized)
        if site is None:
            skipped[value] = reason
        else:
            sites.append(site)
    return sites, skipped


def _site(g, value, readers, producers, users, quantized) -> tuple[str, FoldSite | None]:
    if any(n.op != "Linear" or n.inputs[0] != value for n in readers):
        return "also read by a non-Linear node", None
    linears = [n.inputs[1] for n in readers]
    if not all(quantized(w) for w in linears):
        return "not every reader is quantized", None
    if any(u not in readers for w in linears for u in users[w]):
        return "a weight is shared with another input", None
    producer = producers.get(value)
    found = _fold_target(g, value, producer, users, producers) if producer is not None else None
    if found is None:
        return f"produced by {producer.op if producer else 'a graph input'}: no exact fold", None
    targets, tie = found
    return "", FoldSite(value, linears, targets, tie)


def _fold_target(g: Graph, value: str, producer: Node, users, producers):
    """([(weight, first row)], tie) that can absorb 1/s for `value`, the producer's output, or None."""
    if producer.op in ("RMSNorm", "SkipRMSNorm") and value == producer.outputs[0]:
        return _rows(producer.inputs[-1], 0, None, users, producer)
    if producer.op == "GatedActivation":
        linear = _private_linear(producer.inputs[0], producers, users)
        half = g.values[producer.inputs[0]].shape[-1] // 2
        return linear and _rows(linear.inputs[1:], half, None, users, linear)
    if producer.op == "Mul":
        act = producers.get(producer.inputs[0])
        linear = _private_linear(producer.inputs[1], producers, users)
        good = act is not None and act.op == "Activation" and linear is not None
        return _rows(linear.inputs[1:], 0, None, users, linear) if good else None
    if producer.op == "Attention":
        return _attention_target(producer, producers, users)
    return None


def _attention_target(attn: Node, producers, users):
    a = attn.attrs
    tie = HeadTie(a["kv_heads"], a["num_heads"], a["head_dim"])
    source = attn.inputs[0] if a["packed_qkv"] else attn.inputs[2]
    start = (a["num_heads"] + a["kv_heads"]) * a["head_dim"] if a["packed_qkv"] else 0
    split = producers.get(source)
    if split is not None and split.op == "Split":  # v, the last part of a fused q/k/v (fuse_qkv)
        start = sum(split.attrs["sizes"][:split.outputs.index(source)])
        source = split.inputs[0]
    linear = _private_linear(source, producers, users)
    return linear and _rows(linear.inputs[1:], start, tie, users, linear)


def _private_linear(value: str, producers, users) -> Node | None:
    node = producers.get(value)
    private = node is not None and node.op == "Linear" and len(users[value]) == 1
    return node if private else None


def _rows(weights, start: int, tie, users, owner: Node):
    weights = [weights] if isinstance(weights, str) else [w for w in weights if w]
    if any(len(users[w]) != 1 or users[w][0] is not owner for w in weights):
        return None  # a weight also read elsewhere cannot absorb the scale
    return [(w, start) for w in weights], tie


def fold(g: Graph, site: FoldSite, scale: np.ndarray) -> None:
    """W * s for the site's linears, 1/s into its targets' rows; exact in float arithmetic."""
    for name in site.linears:
        g.weights[name] = ScaledWeight(g.weights[name], scale, axis=1)
    rows = site.tie.per_kv_channel(scale) if site.tie else scale
    for name, start in site.targets:
        g.weights[name] = ScaledWeight(g.weights[name], (1.0 / rows).astype(np.float32), axis=0, start=start)
