"""FuseQKV: three Linear projections of one input feeding an Attention become one Linear whose
weight is the lazy concatenation [Wq; Wk; Wv], and the Attention reads the packed result. Projections stored
in different pre-quantized layouts (a GGUF file's Q4_K q/k beside a Q6_K v) stay apart, each in its own."""
from __future__ import annotations

from builder.ir import Graph, concatenable
from builder.pass_manager import Pass
from builder.quant.weights import same_storage


class FuseQKV(Pass):
    name = "fuse_qkv"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        producers, users = g.producers(), g.uses()
        for attn in list(g.nodes_of("Attention")):
            if attn.attrs["packed_qkv"]:
                continue
            projections = [producers.get(name) for name in attn.inputs[:3]]
            if concatenable(projections, users) and same_storage([g.weights[p.inputs[1]] for p in projections]):
                packed = g.concat_linears(projections, "qkv")
                attn.inputs = [packed, "", ""] + attn.inputs[3:]  # keeps the sinks (gpt-oss)
                attn.attrs["packed_qkv"] = True
        return g
