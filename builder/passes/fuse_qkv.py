"""FuseQKV: three Linear projections of one input feeding an Attention become one Linear whose
weight is the lazy concatenation [Wq; Wk; Wv]. Where all three feed the Attention directly, it reads the packed
result; where some go on through per-head ops first (Qwen3's and Gemma 3's q/k norms, an unfolded rotary), a Split
hands each part to its own consumers as before. Projections stored in different pre-quantized layouts (a GGUF
file's Q4_K q/k beside a Q6_K v) stay apart, each in its own."""
from __future__ import annotations

from builder.ir import Graph, Node, concatenable
from builder.ops import PER_HEAD
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
            projections = [_projection(name, producers, users) for name in attn.inputs[:3]]
            if not concatenable(projections, users) or not same_storage([g.weights[p.inputs[1]] for p in projections]):
                continue
            if [p.outputs[0] for p in projections] == attn.inputs[:3]:
                attn.inputs = [g.concat_linears(projections, "qkv"), "", ""] + attn.inputs[3:]  # keeps the sinks
                attn.attrs["packed_qkv"] = True
            else:
                _fuse_with_split(g, projections)
        return g


def _projection(value: str, producers: dict[str, Node], users) -> Node | None:
    """The node that makes `value`, looking through per-head ops read by nothing else."""
    node = producers.get(value)
    while node is not None and node.op in PER_HEAD and len(users[node.outputs[0]]) == 1:
        node = producers.get(node.inputs[0])
    return node


def _fuse_with_split(g: Graph, projections: list[Node]) -> None:
    """One fused Linear, then a Split back into the projections' own outputs (their consumers unchanged)."""
    parts = [g.values[p.outputs[0]] for p in projections]
    packed = g.concat_linears(projections, "qkv")
    at = g.nodes.index(g.producers()[packed]) + 1
    g.add_node("Split", [packed], parts, sizes=[v.shape[-1] for v in parts])
    g.nodes.insert(at, g.nodes.pop())
