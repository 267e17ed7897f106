"""fuse_qkv: before/after, the patterns it leaves alone, semantics, regressions.

Split from the former tests/test_ir_and_passes.py; graphs and the numpy interpreter of the IR
are in tests/graph_helpers.py."""
from __future__ import annotations

import numpy as np
import pytest

from builder.ir import Graph
from builder.passes.fold_rotary import FoldRotary
from builder.passes.fuse_qkv import FuseQKV
from builder.quant.schemes import quantize
from builder.quant.weights import Prequantized
from builder.verifier import verify
from builder.weights import Concat
from graph_helpers import (ACT, F32, HEADS, HEAD_DIM, HIDDEN, KV_HEADS, array, assert_same_outputs, attention_block,
                           decoder, decoder_feeds, only, ops)


QKV_WIDTH = (HEADS + 2 * KV_HEADS) * HEAD_DIM
FEED = {"x": np.random.default_rng(0).standard_normal((2, 5, HIDDEN)).astype(np.float32)}


@pytest.mark.parametrize("bias", [False, True])
def test_fuse_qkv_before_after(bias):
    block, _ = attention_block(bias=bias)
    before = FoldRotary().run(block)
    originals = {name: array(before, name) for name in before.weights}
    after = FuseQKV().run(before)
    verify(after)
    assert ops(after) == ["RMSNorm", "Linear", "Attention", "Linear"]
    norm, qkv, attn, o = after.nodes
    assert qkv.inputs == [norm.outputs[0], "layers.0.qkv"] + (["layers.0.qkv_bias"] if bias else [])
    assert attn.inputs == [qkv.outputs[0], "", ""]
    assert attn.attrs["packed_qkv"] is True and attn.attrs["rotary"] is True
    assert after.values[qkv.outputs[0]].shape == ACT + (QKV_WIDTH,)
    assert after.values["layers.0.qkv"].shape == (QKV_WIDTH, HIDDEN)

    fused = after.weights["layers.0.qkv"]
    assert isinstance(fused, Concat)  # lazy: nothing materialized by the pass
    np.testing.assert_array_equal(fused.materialize(), np.concatenate(
        [originals["layers.0.q"], originals["layers.0.k"], originals["layers.0.v"]]))
    if bias:
        np.testing.assert_array_equal(array(after, "layers.0.qkv_bias"), np.concatenate(
            [originals["layers.0.q_bias"], originals["layers.0.k_bias"], originals["layers.0.v_bias"]]))
    gone = {f"layers.0.{p}{s}" for p in "qkv" for s in ("", "_bias")}
    assert not gone & set(after.weights) and not gone & set(after.values)
    assert o.inputs[0] == attn.outputs[0]


def test_fuse_qkv_leaves_shared_projection_output():
    g, _ = attention_block()
    v = only(g, "Attention").inputs[2]
    g.add_output(g.make("Add", [v, v], ACT + (KV_HEADS * HEAD_DIM,), F32))
    _fold_then_qkv(g)


def test_fuse_qkv_leaves_projections_of_different_inputs():
    g, b = attention_block()
    k_lin = next(n for n in g.nodes if n.inputs[1:2] == ["layers.0.k"])
    other = b.rmsnorm("x", "layers.0.k_norm")
    g.nodes.insert(g.nodes.index(k_lin), g.nodes.pop())
    k_lin.inputs[0] = other
    _fold_then_qkv(g)


def test_fuse_qkv_leaves_bias_on_only_some_projections():
    g, b = attention_block()
    k_lin = next(n for n in g.nodes if n.inputs[1:2] == ["layers.0.k"])
    k_lin.inputs.append(b.weight("layers.0.k_bias", KV_HEADS * HEAD_DIM))
    _fold_then_qkv(g)


def test_fuse_qkv_through_unfolded_rotary_keeps_the_rotary():
    g, _ = attention_block()
    after = FuseQKV().run(g)
    verify(after)
    assert ops(after) == ["RMSNorm", "Linear", "Split", "Rotary", "Rotary", "Attention", "Linear"]
    assert only(after, "Attention").attrs["packed_qkv"] is False
    assert_same_outputs(g, after, FEED)


def test_fuse_qkv_skips_already_packed_attention():
    once = FuseQKV().run(FoldRotary().run(attention_block()[0]))
    twice = FuseQKV().run(once)
    assert twice.text() == once.text()


def test_fuse_qkv_fuses_every_layer_and_preserves_semantics():
    for bias in (False, True):
        g = FoldRotary().run(decoder(bias=bias))
        after = FuseQKV().run(g)
        verify(after)
        assert [n.attrs["packed_qkv"] for n in after.nodes_of("Attention")] == [True, True]
        assert {"layers.0.qkv", "layers.1.qkv"} <= set(after.weights)
        assert_same_outputs(g, after, decoder_feeds())


def _fold_then_qkv(g: Graph) -> Graph:
    verify(g)
    before = FoldRotary().run(g)
    after = FuseQKV().run(before)
    verify(after)
    assert ops(after) == ops(before)
    assert only(after, "Attention").attrs["packed_qkv"] is False
    assert "layers.0.qkv" not in after.weights
    return after


def _qkv_graph_with_explicit_absent_bias() -> Graph:
    g, _ = attention_block(rotate=False)
    for n in g.nodes_of("Linear"):
        if n.inputs[1] in ("layers.0.q", "layers.0.k", "layers.0.v"):
            n.inputs.append("")  # an empty input name is an absent optional input (ir.Node docstring)
    verify(g)
    return g


def test_regression_fuse_qkv_with_explicit_absent_bias():
    after = FuseQKV().run(_qkv_graph_with_explicit_absent_bias())
    verify(after)


def test_regression_fuse_qkv_deletes_weight_still_used_elsewhere():
    g, _ = attention_block(rotate=False)
    g.add_output(g.make("Linear", ["x", "layers.0.q"], ACT + (HEADS * HEAD_DIM,), F32))
    verify(g)
    verify(FuseQKV().run(g))


# -- q and k going on through their head norms (Qwen3): one Linear, then a Split -----------------------
@pytest.mark.parametrize("bias", [False, True])
def test_fuse_qkv_through_head_norms_before_after(bias):
    before = FoldRotary().run(attention_block(bias=bias, head_norm=True)[0])
    parts = [only_linear(before, f"layers.0.{p}").outputs[0] for p in "qkv"]
    after = FuseQKV().run(before)
    verify(after)
    assert ops(after) == ["RMSNorm", "Linear", "Split", "HeadRMSNorm", "HeadRMSNorm", "Attention", "Linear"]
    norm, qkv, split, q_norm, k_norm, attn, _ = after.nodes
    assert qkv.inputs == [norm.outputs[0], "layers.0.qkv"] + (["layers.0.qkv_bias"] if bias else [])
    assert split.inputs == qkv.outputs and split.outputs == parts
    assert split.attrs["sizes"] == [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    assert (q_norm.inputs[0], k_norm.inputs[0]) == tuple(parts[:2])
    assert attn.inputs == [q_norm.outputs[0], k_norm.outputs[0], parts[2]] and attn.attrs["packed_qkv"] is False
    assert isinstance(after.weights["layers.0.qkv"], Concat)
    assert not {"layers.0.q", "layers.0.k", "layers.0.v"} & set(after.weights)
    assert_same_outputs(before, after, FEED)


def test_fuse_qkv_through_head_norms_in_every_layer_of_a_decoder():
    g = FoldRotary().run(decoder(head_norm=True))
    after = FuseQKV().run(g)
    verify(after)
    assert ops(after).count("Split") == 2 and {"layers.0.qkv", "layers.1.qkv"} <= set(after.weights)
    assert_same_outputs(g, after, decoder_feeds())


@pytest.mark.parametrize("v_bits,fused", [(4, True), (8, False)])
def test_fuse_qkv_through_head_norms_only_in_one_stored_layout(v_bits, fused):
    """Pre-quantized q, k (4-bit) fuse with a v of their layout, and stay apart from an 8-bit v (a GGUF file's
    Q4_K q/k beside a Q6_K v)."""
    g = FoldRotary().run(attention_block(head_norm=True)[0])
    for name, bits in (("layers.0.q", 4), ("layers.0.k", 4), ("layers.0.v", v_bits)):
        w = g.weights[name].materialize()
        arrays = quantize(w, bits, 16, symmetric=False)
        g.weights[name] = Prequantized(lambda arrays=arrays: arrays, bits, 16, *w.shape, False, key=name)
    after = FuseQKV().run(g)
    verify(after)
    assert ("Split" in ops(after)) == fused and ("layers.0.qkv" in after.weights) == fused
    assert_same_outputs(g, after, FEED)


def test_fuse_qkv_leaves_a_head_norm_read_elsewhere():
    g, _ = attention_block(head_norm=True)
    q_norm = next(g.nodes_of("HeadRMSNorm"))
    g.add_output(q_norm.outputs[0])
    g = FoldRotary().run(g)
    after = FuseQKV().run(g)
    assert ops(after) == ops(g) and "layers.0.qkv" not in after.weights


def only_linear(g: Graph, weight: str):
    (node,) = [n for n in g.nodes_of("Linear") if n.inputs[1] == weight]
    return node
