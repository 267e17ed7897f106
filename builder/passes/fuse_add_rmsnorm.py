"""FuseAddRMSNorm: RMSNorm(Add(a, b)) -> SkipRMSNorm(a, b), which also yields the sum for the
residual stream (ONNX Runtime SkipSimplifiedLayerNormalization)."""
from __future__ import annotations

from builder.ir import Graph, Node
from builder.pass_manager import Pass


class FuseAddRMSNorm(Pass):
    name = "fuse_add_rmsnorm"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        producers = g.producers()
        for norm in list(g.nodes_of("RMSNorm")):
            add = producers.get(norm.inputs[0])
            if add is None or add.op != "Add":
                continue
            fused = Node("SkipRMSNorm", add.inputs + [norm.inputs[1]], [norm.outputs[0], add.outputs[0]],
                         dict(norm.attrs), g.fresh("SkipRMSNorm"))
            g.nodes[g.nodes.index(add)] = fused
            g.nodes.remove(norm)
            producers = g.producers()
        return g
