"""fuse_add_rmsnorm: before/after, the patterns it leaves alone, semantics.

Split from the former tests/test_ir_and_passes.py; graphs and the numpy interpreter of the IR
are in tests/graph_helpers.py."""
from __future__ import annotations

import numpy as np
import pytest

from builder.ir import Graph
from builder.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from builder.verifier import verify
from builder.weights import ArrayWeight
from graph_helpers import ACT, EPS, F32, HIDDEN, assert_same_outputs, attention_block, decoder, decoder_feeds, ops


def test_fuse_add_rmsnorm_before_after():
    before = decoder(num_layers=1, attention=False)
    assert ops(before) == ["Embedding", "RMSNorm", "Linear", "Linear", "Add", "RMSNorm", "Linear", "Activation",
                           "Linear", "Mul", "Linear", "Add", "RMSNorm", "GatherTokens", "Linear"]
    adds = list(before.nodes_of("Add"))
    norms = list(before.nodes_of("RMSNorm"))
    after = FuseAddRMSNorm().run(before)
    verify(after)
    assert ops(after) == ["Embedding", "RMSNorm", "Linear", "Linear", "SkipRMSNorm", "Linear", "Activation",
                          "Linear", "Mul", "Linear", "SkipRMSNorm", "GatherTokens", "Linear"]
    assert after.nodes[1].inputs == norms[0].inputs  # the embedding's norm has no Add to fuse
    first, second = after.nodes_of("SkipRMSNorm")
    assert first.inputs == adds[0].inputs + ["layers.0.mlp_norm"]
    assert first.outputs == [norms[1].outputs[0], adds[0].outputs[0]]  # y, then the residual sum
    assert first.attrs == {"eps": EPS}
    assert second.inputs == adds[1].inputs + ["final_norm"]
    assert second.outputs == [norms[2].outputs[0], adds[1].outputs[0]]
    # the residual sum keeps its name and still feeds the next residual Add (now the second SkipRMSNorm)
    assert second.inputs[0] == adds[0].outputs[0]


def test_fuse_add_rmsnorm_sum_feeds_later_nodes_and_outputs():
    g = Graph("t")
    x = g.add_input("x", ACT + (HIDDEN,), F32)
    y = g.add_input("y", ACT + (HIDDEN,), F32)
    g.add_weight("w", ArrayWeight(np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32), "w"))
    s = g.make("Add", [x, y], ACT + (HIDDEN,), F32, out="sum")
    n = g.make("RMSNorm", [s, "w"], ACT + (HIDDEN,), F32, out="normed", eps=1e-6)
    z = g.make("Mul", [n, s], ACT + (HIDDEN,), F32, out="z")
    g.add_output(z)
    g.add_output(s)
    after = FuseAddRMSNorm().run(g)
    verify(after)
    assert ops(after) == ["SkipRMSNorm", "Mul"]
    assert after.nodes[0].outputs == ["normed", "sum"] and after.nodes[1].inputs == ["normed", "sum"]
    assert [o.name for o in after.outputs] == ["z", "sum"]
    rng = np.random.default_rng(3)
    feeds = {k: rng.standard_normal((2, 3, HIDDEN)).astype(np.float32) for k in ("x", "y")}
    assert_same_outputs(g, after, feeds)


def test_fuse_add_rmsnorm_leaves_norm_without_add():
    g, _ = attention_block()
    after = FuseAddRMSNorm().run(g)
    assert ops(after) == ops(g)


@pytest.mark.parametrize("attention", [False, True])
def test_fuse_add_rmsnorm_preserves_semantics(attention):
    g = decoder(attention=attention, seed=2)
    after = FuseAddRMSNorm().run(g)
    verify(after)
    assert ops(after).count("SkipRMSNorm") == 4 and "Add" not in ops(after)  # every residual Add feeds a norm
    assert_same_outputs(g, after, decoder_feeds(2))


def test_fuse_add_layernorm_before_after():
    """GPT-2's residual sums: LayerNorm(Add(a, b)) -> SkipLayerNorm(a, b, weight, bias) yielding y and the sum
    (the numbers are checked end to end against transformers in tests/builder/test_families.py, gpt2)."""
    g = Graph("t")
    x = g.add_input("x", ACT + (HIDDEN,), F32)
    y = g.add_input("y", ACT + (HIDDEN,), F32)
    g.add_weight("w", ArrayWeight(np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32), "w"))
    g.add_weight("b", ArrayWeight(np.linspace(-0.1, 0.1, HIDDEN, dtype=np.float32), "b"))
    s = g.make("Add", [x, y], ACT + (HIDDEN,), F32, out="sum")
    n = g.make("LayerNorm", [s, "w", "b"], ACT + (HIDDEN,), F32, out="normed", eps=1e-5)
    g.add_output(g.make("Mul", [n, s], ACT + (HIDDEN,), F32, out="z"))
    after = FuseAddRMSNorm().run(g)
    verify(after)
    assert ops(after) == ["SkipLayerNorm", "Mul"]
    fused = after.nodes[0]
    assert fused.inputs == ["x", "y", "w", "b"] and fused.outputs == ["normed", "sum"]
    assert fused.attrs == {"eps": 1e-5}
