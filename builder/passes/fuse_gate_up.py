"""FuseGateUp: Mul(act(Linear_gate(x)), Linear_up(x)) -> GatedActivation(Linear_gate_up(x)).

One matmul with the lazily concatenated weight [Wgate; Wup] instead of two; not where the two are stored in
different pre-quantized layouts (builder/quant/weights.py same_storage)."""
from __future__ import annotations

from builder.ir import Graph, Value
from builder.pass_manager import Pass
from builder.quant.weights import same_storage
from builder.weights import Concat


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
            if _fusable(gate, up, users) and same_storage([g.weights[p.inputs[1]] for p in (gate, up)]):
                _fuse(g, mul, act, gate, up)
        return g


def _fusable(gate, up, users) -> bool:
    linear = all(p is not None and p.op == "Linear" for p in (gate, up))
    return (linear and gate.inputs[0] == up.inputs[0] and gate.has_bias == up.has_bias
            and all(len(users[p.outputs[0]]) == 1 for p in (gate, up)))


def _fuse(g: Graph, mul, act, gate, up) -> None:
    prefix = gate.inputs[1].rsplit(".", 1)[0]
    inputs = [gate.inputs[0], g.add_weight(f"{prefix}.gate_up",
                                           Concat([g.weights[gate.inputs[1]], g.weights[up.inputs[1]]]))]
    if gate.has_bias:
        inputs.append(g.add_weight(f"{prefix}.gate_up_bias",
                                   Concat([g.weights[gate.inputs[2]], g.weights[up.inputs[2]]])))
    y = g.values[mul.outputs[0]]
    packed = Value(g.fresh("gate_up"), y.shape[:-1] + (2 * y.shape[-1],), y.dtype)
    position = g.nodes.index(gate)
    g.add_node("Linear", inputs, [packed])
    g.add_node("GatedActivation", [packed.name], [y], fn=act.attrs["fn"])
    fused = g.nodes[-2:]
    g.nodes = g.nodes[:-2]
    g.nodes[position:position] = fused
    g.nodes = [n for n in g.nodes if n not in (mul, act, gate, up)]
    g.drop_unused_weights(gate.inputs[1:] + up.inputs[1:])
