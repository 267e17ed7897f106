"""Cut a tensor-parallel rank's graph at its AllReduce nodes into segments, and lower each segment to
an ONNX model of its own (ONNX Runtime's released wheels have no collective ops: the runtime runs a
segment, all-reduces its cut value with torch.distributed, and runs the next).

A segment reads the values earlier segments (or the engine's inputs) produced and writes the values
later ones read; an all-reduce's output shares its input's buffer. The graph after the last all-reduce
(final norm, lm_head) computes the same on every rank, so only rank 0 has it."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx

from builder.ir import Graph, Node
from builder.lower_onnx import Lowering
from runtime.manifest.types import IO, Collective, SegmentFile

INTEGER = ("int64", "int32", "uint8")


@dataclass
class Segment:
    """Nodes between two cuts; `inputs`/`outputs`: the values it reads from / leaves for the others."""

    nodes: list[Node]
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


def split_segments(g: Graph) -> tuple[list[Segment], list[Collective]]:
    """The graph's segments in order and the collectives between them."""
    segments, collectives, current = [], [], []
    for node in g.nodes:
        if node.op == "AllReduce":
            segments.append(Segment(current))
            collectives.append(Collective(len(segments) - 1, node.inputs[0], node.outputs[0]))
            current = []
        else:
            current.append(node)
    segments.append(Segment(current))
    needed_after = {o.name for o in g.outputs}
    for seg, cut in reversed(list(zip(segments, [None] + collectives))):
        produced = [o for n in seg.nodes for o in n.outputs]
        read = [i for n in seg.nodes for i in n.inputs if i and i not in g.weights]
        seg.outputs = [o for o in produced if o in needed_after]
        seg.inputs = list(dict.fromkeys(i for i in read if i not in produced))
        needed_after |= set(seg.inputs)
        if cut is not None:  # the cut before this segment: its output is read here, its input written before
            needed_after.add(cut.input)
    return segments, collectives


def segment_graph(g: Graph, seg: Segment, name: str) -> Graph:
    """One segment as a graph of its own (sharing the values and the weights it reads)."""
    used = {i for n in seg.nodes for i in n.inputs if i in g.weights}
    return Graph(name, inputs=[g.values[i] for i in seg.inputs], outputs=[g.values[o] for o in seg.outputs],
                 nodes=seg.nodes, values=g.values, weights={w: g.weights[w] for w in used}, meta=g.meta)


class SegmentLowering(Lowering):
    """Lowers a segment with Lowering's interface, where the graph's inputs and outputs are the boundary
    values the segment reads and writes, and the KV and attention inputs are those of its own layers only
    (none without attention). Float activations cross the cuts in the target dtype; the model's outputs
    (`logits`, the sampling head's) keep their own dtype (float32) as in a whole engine."""

    def __init__(self, graph: Graph, data_path: Path, dtype: str, logits: str,
                 progress: Callable[[str], None] | None = None, model_outputs: frozenset[str] = frozenset()):
        super().__init__(graph, data_path, dtype, progress)
        self.logits, self.model_outputs = logits, model_outputs | {logits}

    def _io_dtype(self, name: str) -> str:
        dtype = self.g.values[name].dtype
        return dtype if dtype in INTEGER or name in self.model_outputs else self.dtype

    def _kv_layers(self) -> list[int]:
        return [n.attrs["layer"] for n in self.g.nodes_of("Attention")]


def write_rank(g: Graph, directory: Path, rank: int, dtype: str,
               progress: Callable[[str], None] | None = None) -> tuple[list[SegmentFile], list[Collective]]:
    """Lower rank `rank`'s segments to `rank{r}.seg{k}.onnx` (+ `.data`) in `directory`; returns the
    manifest entries of its segments and the collectives between them. Ranks other than 0 stop at the
    last collective."""
    segments, collectives = split_segments(g)
    if rank != 0 and collectives:
        segments = segments[:len(collectives)]
    logits = g.outputs[0].name
    entries = []
    for k, seg in enumerate(segments):
        path = directory / f"rank{rank}.seg{k:02d}.onnx"
        sub = segment_graph(g, seg, f"{g.name}.rank{rank}.seg{k}")
        model, io = SegmentLowering(sub, path.with_name(path.name + ".data"), dtype, logits, progress,
                                    frozenset(o.name for o in g.outputs)).lower()
        onnx.save_model(model, str(path))
        layers = tuple(sorted(n.attrs["layer"] for n in seg.nodes if n.op == "Attention"))
        entries.append(SegmentFile(path.name, layers, io.inputs, io.outputs))
    return entries, collectives


def segments_io(g: Graph) -> IO:
    """The interface of the whole engine its segments make up (rank 0's graph): the model's inputs, and its
    outputs in float32, as a single-device engine declares them."""
    return IO({v.name: {"dtype": v.dtype, "shape": list(v.shape)} for v in g.inputs},
              {v.name: {"dtype": "float32", "shape": list(v.shape)} for v in g.outputs})
