"""FuseQKV: three Linear projections of one input feeding an Attention become one Linear whose
weight is the lazy concatenation [Wq; Wk; Wv], and the Attention reads the packed result. Projections stored
in different pre-quantized layouts (a GGUF file's Q4_K q/k beside a Q6_K v) stay apart, each in its own."""
from __future__ import annotations

from builder.ir import Graph, Value
from builder.pass_manager import Pass
from builder.quant.weights import same_storage
from builder.weights import Concat


class FuseQKV(Pass):
    name = "fuse_qkv"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        producers, users = g.producers(), g.uses()
        for attn in list(g.nodes_of("Attention")):
            if attn.attrs["packed_qkv"]:
                continue
            projections = [producers.get(name) for name in attn.inputs[:3]]
            if not _fusable(projections, users) or not same_storage([g.weights[p.inputs[1]] for p in projections]):
                continue
            _fuse(g, attn, projections)
        return g


def _fusable(projections, users) -> bool:
    if len(projections) != 3 or any(p is None or p.op != "Linear" for p in projections):
        return False
    same_input = len({p.inputs[0] for p in projections}) == 1
    bias_all_or_none = len({p.has_bias for p in projections}) == 1
    private = all(len(users[p.outputs[0]]) == 1 for p in projections)
    return same_input and bias_all_or_none and private


def _fuse(g: Graph, attn, projections) -> None:
    q = projections[0]
    prefix = q.inputs[1].rsplit(".", 1)[0]
    weight = g.add_weight(f"{prefix}.qkv", Concat([g.weights[p.inputs[1]] for p in projections]))
    inputs = [q.inputs[0], weight]
    if q.has_bias:
        inputs.append(g.add_weight(f"{prefix}.qkv_bias", Concat([g.weights[p.inputs[2]] for p in projections])))
    width = sum(g.values[p.outputs[0]].shape[-1] for p in projections)
    x = g.values[q.outputs[0]]
    out = Value(g.fresh("qkv"), x.shape[:-1] + (width,), x.dtype)
    position = g.nodes.index(q)
    g.add_node("Linear", inputs, [out])
    g.nodes.insert(position, g.nodes.pop())
    g.nodes = [n for n in g.nodes if n not in projections]
    attn.inputs = [out.name, "", ""] + attn.inputs[3:]  # keeps the sinks (gpt-oss)
    attn.attrs["packed_qkv"] = True
    g.drop_unused_weights([w for p in projections for w in p.inputs[1:]])
