"""Every pass together: no pass mutates its input, the whole fusion phase keeps the graph's meaning.

Split from the former tests/test_ir_and_passes.py; graphs and the numpy interpreter of the IR
are in tests/graph_helpers.py."""
from __future__ import annotations

import pytest

from builder.passes.fold_rotary import FoldRotary
from builder.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from builder.passes.fuse_gate_up import FuseGateUp
from builder.passes.fuse_qkv import FuseQKV
from builder.passes.plan_kv_cache import PlanKVCache
from builder.passes.remove_dead_nodes import RemoveDeadNodes
from builder.verifier import verify
from graph_helpers import F32, assert_same_outputs, attention_block, decoder, decoder_feeds, only, ops


@pytest.mark.parametrize("make_pass", [FoldRotary, FuseQKV, FuseGateUp, FuseAddRMSNorm, RemoveDeadNodes,
                                       lambda: PlanKVCache(2, 16, F32)])
def test_passes_do_not_mutate_their_input(make_pass):
    g = FoldRotary().run(decoder()) if make_pass is FuseQKV else decoder()
    text, weights, values = g.text(), dict(g.weights), dict(g.values)
    verify(make_pass().run(g))
    assert g.text() == text and g.weights == weights and g.values == values


def test_whole_fusion_phase_preserves_semantics():
    for bias in (False, True):
        g = decoder(bias=bias, seed=4)
        fused = g
        for p in (FoldRotary(), FuseQKV(), FuseGateUp(), FuseAddRMSNorm()):
            fused = p.run(fused)
            verify(fused)
        layer = ["Linear", "Attention", "Linear", "SkipRMSNorm", "Linear", "GatedActivation", "Linear", "SkipRMSNorm"]
        assert ops(fused) == ["Embedding", "RMSNorm"] + layer + layer + ["GatherTokens", "Linear"]
        assert_same_outputs(g, fused, decoder_feeds(4))
        assert fused.num_parameters() == g.num_parameters()


def test_regression_fusion_removes_value_that_is_a_graph_output():
    g, _ = attention_block(rotate=False)
    k = only(g, "Attention").inputs[1]
    g.add_output(k)
    verify(g)
    verify(FuseQKV().run(g))
