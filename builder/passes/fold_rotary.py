"""FoldRotary: Attention(Rotary(q), Rotary(k), v) -> Attention(q, k, v, rotary=True).

The back end's attention kernel applies the rotary embedding itself (GroupQueryAttention do_rotary). A layer
whose Rotary nodes name their own table (attr `table`, Gemma 3's sliding layers) passes it on to its Attention."""
from __future__ import annotations

from builder.ir import Graph
from builder.pass_manager import Pass


class FoldRotary(Pass):
    name = "fold_rotary"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        producers, users = g.producers(), g.uses()
        for attn in g.nodes_of("Attention"):
            if attn.attrs["rotary"] or attn.attrs["packed_qkv"]:
                continue
            q, k = (producers.get(name) for name in attn.inputs[:2])
            if not _sole_rotary(q, users) or not _sole_rotary(k, users):
                continue
            if q.attrs.get("table") != k.attrs.get("table"):  # q and k rotated by different tables: left as is
                continue
            attn.inputs[:2] = [q.inputs[0], k.inputs[0]]
            attn.attrs["rotary"] = True
            if q.attrs.get("table") is not None:  # this layer's own rotary table (graph.meta.layer_ropes)
                attn.attrs["table"] = q.attrs["table"]
            g.nodes = [n for n in g.nodes if n is not q and n is not k]
        return g


def _sole_rotary(node, users) -> bool:
    return node is not None and node.op == "Rotary" and len(users[node.outputs[0]]) == 1
