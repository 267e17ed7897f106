"""PermuteActivations: Linear(x, W) whose weight is stored with its input columns permuted (a GPTQ desc_act
checkpoint: builder/quant/formats/gptq.py sorts the columns by group) -> Linear(PermuteColumns(x, order),
W[:, order]), so that MatMulNBits reads the weight as stored, each group in contiguous blocks.

Linears reading the same input in the same order share one PermuteColumns (GPTQ computes q/k/v's and
gate/up's order from the same input, so they stay fusable); a different order gets its own. Runs before
the fusions. MatMulNBits' own `g_idx` input is exact too but 15-280x slower on the CPU (it dequantizes
to float on every call; docs/BENCHMARKS.md, "GPTQ desc_act import"); the Gather costs 0-25% of one call."""
from __future__ import annotations

import numpy as np

from builder.ir import Graph, Node
from builder.pass_manager import Pass
from builder.quant.weights import PermutedColumns, Prequantized
from builder.weights import ArrayWeight


class PermuteActivations(Pass):
    name = "permute_activations"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        permuted = {name: source for name, source in g.weights.items()
                    if isinstance(source, Prequantized) and source.order is not None}
        shared: dict[tuple[str, bytes], str] = {}  # (input, order) -> the permuted input
        for node in [n for n in g.nodes if n.op == "Linear" and n.inputs[1] in permuted]:
            order = permuted[node.inputs[1]].order
            key = (node.inputs[0], order.tobytes())
            if key not in shared:
                shared[key] = _permute(g, node, order)
            node.inputs[0] = shared[key]
        for name, source in permuted.items():
            g.weights[name] = PermutedColumns(source, source.order)
        return g


def _permute(g: Graph, linear: Node, order: np.ndarray) -> str:
    """A PermuteColumns of the linear's input, placed just before it."""
    x = g.values[linear.inputs[0]]
    prefix = linear.inputs[1].rsplit(".", 1)[0]
    index = g.add_weight(g.fresh(f"{prefix}.input_order"), ArrayWeight(order.astype(np.int64), "desc_act_order"))
    out = g.make("PermuteColumns", [x.name, index], x.shape, x.dtype, f"{prefix}.permuted_input")
    g.nodes.insert(g.nodes.index(linear), g.nodes.pop())
    return out
