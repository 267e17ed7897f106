"""remove_dead_nodes.

Split from the former tests/test_ir_and_passes.py; graphs and the numpy interpreter of the IR
are in tests/graph_helpers.py."""
from __future__ import annotations

import numpy as np

from builder.ir import Graph, Value
from builder.passes.remove_dead_nodes import RemoveDeadNodes
from builder.verifier import verify
from builder.weights import ArrayWeight
from graph_helpers import ACT, F32, decoder, mlp_block, only, ops


def test_remove_dead_nodes_drops_unreachable_nodes_weights_and_values():
    g, b = mlp_block()
    h = only(g, "RMSNorm").outputs[0]
    dead = b.linear(h, "dead.proj", 3)  # computed from live values but feeds no output
    dead2 = g.make("Activation", [dead], ACT + (3,), F32, fn="silu")
    b.weight("never_used", 5)
    g.add_input("unused_input", ("n",), "int64")
    verify(g)
    after = RemoveDeadNodes().run(g)
    verify(after)
    assert ops(after) == ["RMSNorm", "Linear", "Activation", "Linear", "Mul", "Linear", "Add"]
    assert set(after.weights) == set(g.weights) - {"dead.proj", "never_used"}
    assert not {dead, dead2, "dead.proj", "never_used"} & set(after.values)
    assert [v.name for v in after.inputs] == ["x", "unused_input"] and "unused_input" in after.values
    assert after.outputs == g.outputs


def test_remove_dead_nodes_keeps_multi_output_node_with_one_live_output():
    g = Graph("t")
    x = g.add_input("x", ("n", 4), F32)
    g.add_weight("w", ArrayWeight(np.ones(4, np.float32), "w"))
    g.add_node("SkipRMSNorm", [x, x, "w"], [Value("y", ("n", 4), F32), Value("s", ("n", 4), F32)], eps=1e-5)
    g.add_output("s")
    after = RemoveDeadNodes().run(g)
    verify(after)
    assert ops(after) == ["SkipRMSNorm"] and set(after.values) >= {"y", "s", "w"}


def test_remove_dead_nodes_is_identity_on_live_graph():
    g = decoder()
    after = RemoveDeadNodes().run(g)
    assert after.text() == g.text() and after.values.keys() == g.values.keys()
