"""RemoveDeadNodes: drop nodes, weights and values that no graph output depends on."""
from __future__ import annotations

from builder.ir import Graph
from builder.pass_manager import Pass


class RemoveDeadNodes(Pass):
    name = "remove_dead_nodes"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        live = {o.name for o in g.outputs}
        kept = []
        for node in reversed(g.nodes):
            if any(o in live for o in node.outputs):
                kept.append(node)
                live.update(i for i in node.inputs if i)
        g.nodes = kept[::-1]
        live |= {v.name for v in g.inputs}
        g.weights = {k: w for k, w in g.weights.items() if k in live}
        live |= {o for n in g.nodes for o in n.outputs}
        g.values = {k: v for k, v in g.values.items() if k in live}
        return g
