"""FuseGateUp: Mul(act(Linear_gate(x)), Linear_up(x)) -> GatedActivation(Linear_gate_up(x)).

One matmul with the lazily concatenated weight [Wgate; Wup] instead of two; not where the two are stored in
different pre-quantized layouts (builder/quant/weights.py same_storage)."""
from __future__ import annotations

from builder.ir import Graph, concatenable
from builder.pass_manager import Pass
from builder.quant.weights import same_storage


class FuseGateUp(Pass):
    name = "fuse_gate_up"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        producers, users = g.producers(), g.uses()
        for mul in list(g.nodes_of("Mul")):
            act = producers.get(mul.inputs[0])
            if act is None or act.op != "Activation" or len(users[act.outputs[0]]) != 1:
                continue
            gate, up = producers.get(act.inputs[0]), producers.get(mul.inputs[1])
            if concatenable([gate, up], users) and same_storage([g.weights[p.inputs[1]] for p in (gate, up)]):
                _fuse(g, mul, act, gate, up)
        return g


def _fuse(g: Graph, mul, act, gate, up) -> None:
    packed = g.concat_linears([gate, up], "gate_up")
    position = g.nodes.index(g.producers()[packed]) + 1
    g.add_node("GatedActivation", [packed], [g.values[mul.outputs[0]]], fn=act.attrs["fn"])
    g.nodes.insert(position, g.nodes.pop())
    g.nodes = [n for n in g.nodes if n is not mul and n is not act]
