"""Split a graph by layers into pipeline stages and lower each to an ONNX model of its own
(`stage{s}.onnx` + `.data`).

Stage s holds contiguous layers [a_s, b_s): the first also the embedding, the last also the final norm,
lm_head and the sampling head. A node belongs to the layer whose weights (`layers.N.*`) it reads or whose
Attention it is; nodes that read no layer weight stay with the nodes around them, so a stage is a contiguous
run of the graph's node list and the stages together are the whole graph, in order. What crosses a cut is
what is live there: the values made before it (not the engine's inputs, which every stage is given) and read
after it, the hidden states of the residual stream (with fused add + RMSNorm, the last sum and the MLP's
output). A stage forwards what it received and a later stage reads.

The split is planned before any weight is read (`plan_stages`: balanced by each layer's per-token compute,
`layer_costs`, or the recipe's `pipeline_layers`), and a bad split is refused there, naming the numbers."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from builder.ir import Graph
from builder.segments import Segment, SegmentLowering, segment_graph, split_segments
from runtime.manifest.types import Collective, PipelineParallel, PipelineStage, SegmentFile, StageRank

LAYER_WEIGHT = re.compile(r"^layers\.(\d+)\.")


class StageError(ValueError):
    """The model cannot be split into these pipeline stages."""


def node_layers(g: Graph) -> list[int | None]:
    """Each node's layer: its Attention's, or that of the `layers.N.` weights it reads; None for a node that
    reads neither (it stays with its neighbours)."""
    layers = []
    for node in g.nodes:
        found = {int(m.group(1)) for i in node.inputs if i in g.weights and (m := LAYER_WEIGHT.match(i))}
        if node.op == "Attention":
            found.add(node.attrs["layer"])
        layers.append(max(found) if found else None)
    return layers


def layer_costs(g: Graph, num_layers: int, table=None) -> tuple[list[float], float]:
    """Each layer's per-token compute, and that of the weights outside the layers (the final norm and lm_head),
    for balancing the stages by what they compute rather than what they store: a weight costs the values a token
    multiplies by (`token_values`), scaled by its kernel's measured time per weight where `table` (a KernelTable:
    builder/data/kernel_table.json) has a figure for the bits and block of every pre-quantized weight (on
    AVX-512 a Q8_0 lm_head value costs ~0.8 of a Q4_1 layer value, not the 1.6 its bytes say), else unscaled."""
    values = token_values(g)
    scale = _per_value(table, [g.weights[name] for name in values])
    per_layer, rest = [0.0] * num_layers, 0.0
    for name, count in values.items():
        cost = count * scale(g.weights[name])
        if m := LAYER_WEIGHT.match(name):
            per_layer[int(m.group(1))] += cost
        else:
            rest += cost
    return per_layer, rest


def token_values(g: Graph) -> dict[str, float]:
    """Weight name -> the values one token multiplies by: all of a matmul's or norm's, none of an embedding
    gathered one row a token, top_k / experts of an MoE's stacked experts ([experts, ...])."""
    values: dict[str, float] = {}
    for node in g.nodes:
        for name in (i for i in node.inputs if i in g.weights):
            shape = g.weights[name].shape
            share = 0.0 if node.op in ("Embedding", "GatherBlockQuantized") else 1.0
            if node.op == "MoE" and len(shape) == 3:
                share = node.attrs["top_k"] / shape[0]
            values[name] = max(values.get(name, 0.0), share * int(np.prod(shape)))  # a tied embedding: as lm_head
    return {name: v for name, v in values.items() if v}


def _per_value(table, sources: list) -> Callable[[object], float]:
    """A weight's time per value from `table` when it has a figure for the bits and block of every pre-quantized
    weight in `sources` (a float one, a norm's, then costs what the slowest of those does), else 1 for every
    weight."""
    figures = {}
    for source in sources:
        bits, block = getattr(source, "bits", None), getattr(source, "block", None)
        if isinstance(bits, int) and isinstance(block, int):
            figure = table.time_us(bits, block, table.fastest(bits, block), 1) if table is not None else None
            if figure is None:
                return lambda source: 1.0
            figures[bits, block] = figure
    if not figures:
        return lambda source: 1.0
    slowest = max(figures.values())
    return lambda source: figures.get((getattr(source, "bits", None), getattr(source, "block", None)), slowest)


def weight_bytes(source) -> int:
    """A weight's stored bytes: a pre-quantized one's `bits` per value, else its dtype's."""
    values = int(np.prod(source.shape))
    if isinstance(getattr(source, "bits", None), int):
        return values * source.bits // 8
    return values * (2 if source.dtype == "bfloat16" else np.dtype(source.dtype).itemsize)


def plan_stages(num_layers: int, stages: int, given: list[int] | None = None,
                costs: list[float] | None = None, last_extra: float = 0) -> list[tuple[int, int]]:
    """The stages' layer ranges [a, b): `given` (layers per stage, which must add up to `num_layers`), else
    contiguous ranges minimizing the largest stage's cost (`costs` per layer, `last_extra` on the last stage:
    the lm_head). Refuses more stages than layers and an empty stage."""
    if stages > num_layers:
        raise StageError(f"parallel.pipeline_parallel {stages} is more than the model's {num_layers} layers; every "
                         f"stage holds at least one layer: use pipeline_parallel <= {num_layers}")
    if given is not None:
        if sum(given) != num_layers or any(n < 1 for n in given):
            raise StageError(f"parallel.pipeline_layers {given} adds up to {sum(given)} layers; the model has "
                             f"{num_layers}, and every stage holds at least one: give {stages} counts >= 1 that add "
                             f"up to {num_layers}")
        bounds = np.cumsum([0, *given]).tolist()
        return list(zip(bounds[:-1], bounds[1:]))
    return _balanced(costs or [1] * num_layers, stages, last_extra)


def _balanced(costs: list[float], stages: int, last_extra: float) -> list[tuple[int, int]]:
    """Contiguous ranges of `costs` over `stages`, the largest stage cost as small as it can be (DP over cut
    points; on a tie the later cuts: the earlier stages take the extra layers, the last one, with the lm_head,
    the fewest)."""
    n, prefix = len(costs), np.cumsum([0, *costs]).tolist()
    best = {(0, 0): (0, [])}  # (stages used, layers covered) -> (largest cost, cuts)
    for s in range(1, stages + 1):
        for end in range(s, n - (stages - s) + 1):
            options = []
            for start in range(s - 1, end):
                if (s - 1, start) not in best:
                    continue
                worst, cuts = best[(s - 1, start)]
                cost = prefix[end] - prefix[start] + (last_extra if s == stages else 0)
                options.append((max(worst, cost), cuts + [end]))
            if options:
                best[(s, end)] = min(options, key=lambda o: (o[0], [-c for c in o[1]]))
    bounds = [0, *best[(stages, n)][1]]
    return list(zip(bounds[:-1], bounds[1:]))


def split_stages(g: Graph, ranges: list[tuple[int, int]]) -> list[Segment]:
    """The graph's nodes cut at the first node of each stage's first layer; each Segment's `inputs` are the
    values it reads that an earlier stage made, `outputs` those it makes or forwards that a later stage (or
    the engine's caller) reads."""
    layers = node_layers(g)
    cuts = [0]
    for first, _ in ranges[1:]:
        at = next(i for i, layer in enumerate(layers) if layer is not None and layer >= first)
        stray = [g.nodes[i].name for i in range(at, len(layers)) if layers[i] is not None and layers[i] < first]
        if stray:
            raise StageError(f"nodes of layers before {first} come after its first node ({', '.join(stray[:3])}): "
                             f"the graph's order does not allow a cut before layer {first}")
        cuts.append(at)
    cuts.append(len(g.nodes))
    segments = [Segment(g.nodes[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    given = {v.name for v in g.inputs}
    needed_after = {o.name for o in g.outputs}
    for seg in reversed(segments):
        produced = {o for n in seg.nodes for o in n.outputs}
        read = [i for n in seg.nodes for i in n.inputs if i and i not in g.weights]
        seg.inputs = list(dict.fromkeys(i for i in read if i not in produced))
        # its outputs: what later stages read, made here or forwarded (received, not made)
        seg.outputs = sorted(o for o in needed_after if o not in given)
        needed_after = (needed_after - produced) | set(seg.inputs)
    return segments


def write_stages(graphs: list[Graph], directory: Path, ranges: list[tuple[int, int]], dtype: str,
                 progress: Callable[[str], None] | None = None) -> PipelineParallel:
    """Lower each stage of each tensor-parallel rank's graph (`graphs`: one, or rank t's at t) into `directory`:
    without tensor parallelism `stage{s}.onnx` (+ `.data`, its own weights only, read as written), with it
    `stage{s}.rank{t}.seg{k}.onnx`, the stage's nodes cut at its all-reduces (builder/segments.py) as a
    tensor-parallel rank's are. Returns the manifest's pipeline_parallel section."""
    tp, model_outputs = len(graphs), frozenset(o.name for o in graphs[0].outputs)
    cut = [split_stages(g, ranges) for g in graphs]  # [tp rank][stage]
    stages, receives = [], {}
    for s in range(len(ranges)):
        ranks, collectives, made, weight = [], (), {}, 0
        for t, g in enumerate(graphs):
            headless = s == len(ranges) - 1 and t > 0
            segments, collectives, io, written = _write_stage_rank(g, cut[t][s], directory, s, t, tp, headless,
                                                                   dtype, progress)
            ranks.append(StageRank(t, 1 + s * tp + t, tuple(segments)))
            made, weight = made or io, weight + written
        seg = cut[0][s]
        sends = {o: made.get(o) or receives[o] for o in seg.outputs if o not in model_outputs}
        stages.append(PipelineStage(s, ranges[s], _holds(seg, s, len(ranges)), tuple(ranks), receives, sends, weight,
                                    tuple(collectives)))
        receives = sends
    return PipelineParallel(size=len(stages), stages=tuple(stages), tensor_parallel=tp)


def _write_stage_rank(g: Graph, seg: Segment, directory: Path, stage: int, rank: int, tp: int, headless: bool,
                      dtype: str, progress) -> tuple[list[SegmentFile], list[Collective], dict, int]:
    """Stage `stage` of tp rank `rank`'s graph lowered: its segments (cut at its AllReduce nodes; `headless`, a
    last stage's tp rank > 0, stops at the last, as a tensor-parallel rank does), the all-reduces between them,
    the {name: info} of the values it makes (an all-reduce's output as its input) and its weight bytes."""
    # a value forwarded (received and sent on unread) is an output of no ONNX model: the runtime passes it on
    produced = {o for n in seg.nodes for o in n.outputs}
    sub = segment_graph(g, Segment(seg.nodes, seg.inputs, [o for o in seg.outputs if o in produced]),
                        f"{g.name}.stage{stage}")
    parts, collectives = split_segments(sub)
    if headless or not parts[-1].nodes:  # nothing after the last all-reduce here (or no tail to run)
        parts = parts[:len(collectives)] if collectives else parts
    logits, model_outputs = g.outputs[0].name, frozenset(o.name for o in g.outputs)
    entries, made, weight = [], {}, 0
    for k, part in enumerate(parts):
        name = f"stage{stage}.onnx" if tp == 1 else f"stage{stage}.rank{rank}.seg{k:02d}.onnx"
        path, graph = directory / name, segment_graph(sub, part, f"{sub.name}.rank{rank}.seg{k}")
        model, io = SegmentLowering(graph, path.with_name(path.name + ".data"), dtype, logits, progress,
                                    model_outputs).lower()
        weight += sum(weight_bytes(w) for w in graph.weights.values())
        onnx.save_model(model, str(path))
        layers = tuple(sorted(n.attrs["layer"] for n in part.nodes if n.op == "Attention"))
        entries.append(SegmentFile(path.name, layers, io.inputs, io.outputs))
        made.update(io.outputs)
    for c in collectives:  # an all-reduce's output is its input's buffer
        made[c.output] = made[c.input]
    return entries, collectives, made, weight


def _holds(seg: Segment, stage: int, count: int) -> tuple[str, ...]:
    ops = {n.op for n in seg.nodes}
    holds = ["embedding"] if ops & {"Embedding", "GatherBlockQuantized"} and stage == 0 else []
    if stage == count - 1:
        holds += ["final_norm", "lm_head"] + (["sampling_head"] if ops & {"ArgMax", "TopK"} else [])
    return tuple(holds)
