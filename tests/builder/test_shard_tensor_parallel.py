"""shard_tensor_parallel: before/after on small graphs built inline, for a split and a replicated KV
head; the ranks' partial results sum to the whole graph's."""
from __future__ import annotations

import numpy as np
import pytest

from builder.ir import Shard
from builder.passes.fold_rotary import FoldRotary
from builder.passes.fuse_gate_up import FuseGateUp
from builder.passes.fuse_qkv import FuseQKV
from builder.passes.shard_tensor_parallel import ShardError, ShardTensorParallel
from builder.verifier import verify
from graph_helpers import (ACT, HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, array, attention_block, interpret,
                           mlp_block, only, ops)

FEED = {"x": np.random.default_rng(0).standard_normal((2, 5, HIDDEN)).astype(np.float32)}


def _fused_attention():
    g, _ = attention_block()
    return FuseQKV().run(FoldRotary().run(g))


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_separate_qkv_before_after(tp):
    """Without the packed projection (unfused: e.g. stored in different pre-quantized layouts) q, k and v are
    split each."""
    before = FoldRotary().run(attention_block(bias=True)[0])
    assert ops(before) == ["RMSNorm", "Linear", "Linear", "Linear", "Attention", "Linear"]
    whole, partials = interpret(before, FEED), []
    heads, kv_heads = HEADS // tp, max(1, KV_HEADS // tp)
    for rank in range(tp):
        after = ShardTensorParallel(tp, rank).run(before)
        verify(after)
        assert ops(after) == ["RMSNorm", "Linear", "Linear", "Linear", "Attention", "Linear", "AllReduce"]
        attn = only(after, "Attention")
        assert (attn.attrs["num_heads"], attn.attrs["kv_heads"]) == (heads, kv_heads)
        assert after.values["layers.0.q"].shape == (heads * HEAD_DIM, HIDDEN)
        assert after.values["layers.0.k"].shape == after.values["layers.0.v"].shape == (kv_heads * HEAD_DIM, HIDDEN)
        k0 = rank * KV_HEADS // tp if KV_HEADS >= tp else rank // (tp // KV_HEADS)
        np.testing.assert_array_equal(array(after, "layers.0.k_bias"),
                                      array(before, "layers.0.k_bias")[k0 * HEAD_DIM:(k0 + kv_heads) * HEAD_DIM])
        partials.append(interpret(after, FEED))
    name = before.outputs[0].name
    np.testing.assert_allclose(sum(p[name] for p in partials), whole[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])  # KV heads split (2 over 2 ranks) and replicated (2 over 4)
def test_shard_qkv_fused_through_head_norms_before_after(tp):
    """q, k, v fused into one Linear whose Split feeds Qwen3's q/k norms: the Linear keeps each part's heads
    (q, k and v rows of the rank), the Split and the norms narrow with it."""
    before = FuseQKV().run(FoldRotary().run(attention_block(bias=True, head_norm=True)[0]))
    assert ops(before) == ["RMSNorm", "Linear", "Split", "HeadRMSNorm", "HeadRMSNorm", "Attention", "Linear"]
    whole, partials = interpret(before, FEED), []
    heads, kv_heads = HEADS // tp, max(1, KV_HEADS // tp)
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for rank in range(tp):
        after = ShardTensorParallel(tp, rank).run(before)
        verify(after)
        split = only(after, "Split")
        assert split.attrs["sizes"] == [heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM]
        assert after.values["layers.0.qkv"].shape == ((heads + 2 * kv_heads) * HEAD_DIM, HIDDEN)
        k0 = rank * KV_HEADS // tp if KV_HEADS >= tp else rank // (tp // KV_HEADS)
        bias = array(before, "layers.0.qkv_bias")
        rows = [bias[rank * heads * HEAD_DIM:(rank + 1) * heads * HEAD_DIM]] + [
            bias[at + k0 * HEAD_DIM:at + (k0 + kv_heads) * HEAD_DIM] for at in (q_width, q_width + kv_width)]
        np.testing.assert_array_equal(array(after, "layers.0.qkv_bias"), np.concatenate(rows))
        norms = [after.values[n.outputs[0]].shape[-1] for n in after.nodes_of("HeadRMSNorm")]
        assert norms == [heads * HEAD_DIM, kv_heads * HEAD_DIM]
        partials.append(interpret(after, FEED))
    name = before.outputs[0].name
    np.testing.assert_allclose(sum(p[name] for p in partials), whole[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])  # KV heads split (2 over 2 ranks) and replicated (2 over 4)
def test_shard_attention_before_after(tp):
    before = _fused_attention()
    assert ops(before) == ["RMSNorm", "Linear", "Attention", "Linear"]
    whole = interpret(before, FEED)
    partials = []
    for rank in range(tp):
        after = ShardTensorParallel(tp, rank).run(before)
        verify(after)
        assert ops(after) == ["RMSNorm", "Linear", "Attention", "Linear", "AllReduce"]
        _, qkv, attn, o_proj, reduce = after.nodes
        heads, kv_heads = HEADS // tp, max(1, KV_HEADS // tp)
        assert (attn.attrs["num_heads"], attn.attrs["kv_heads"]) == (heads, kv_heads)
        assert after.values["layers.0.qkv"].shape == ((heads + 2 * kv_heads) * HEAD_DIM, HIDDEN)
        assert after.values["layers.0.o"].shape == (HIDDEN, heads * HEAD_DIM)
        assert reduce.inputs == o_proj.outputs and reduce.outputs == [before.nodes[-1].outputs[0]]
        assert after.meta.tensor_parallel == Shard(tp, rank)
        q = array(after, "layers.0.qkv")[:heads * HEAD_DIM]
        np.testing.assert_array_equal(q, array(before, "layers.0.qkv")[rank * heads * HEAD_DIM:
                                                                       (rank + 1) * heads * HEAD_DIM])
        partials.append(interpret(after, FEED))
    assert before.values["layers.0.qkv"].shape == ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)  # left unchanged
    name = before.outputs[0].name
    np.testing.assert_allclose(sum(p[name] for p in partials), whole[name], rtol=1e-5, atol=1e-5)


def test_shard_unfused_mlp_before_after():
    """Separate gate and up Linears keep the same intermediate channels each."""
    before = mlp_block(bias=True)[0]
    whole, partials = interpret(before, FEED), []
    for rank in range(2):
        after = ShardTensorParallel(2, rank).run(before)
        verify(after)
        assert after.values["layers.0.gate"].shape == after.values["layers.0.up"].shape == (INTER // 2, HIDDEN)
        assert after.values["layers.0.down"].shape == (HIDDEN, INTER // 2)
        partials.append(interpret(after, FEED))
    name = before.outputs[0].name
    np.testing.assert_allclose(sum(p[name] for p in partials) - FEED["x"], whole[name], rtol=1e-5, atol=1e-5)


def test_shard_mlp_before_after():
    before = FuseGateUp().run(mlp_block(bias=True)[0])
    whole, partials = interpret(before, FEED), []
    for rank in range(2):
        after = ShardTensorParallel(2, rank).run(before)
        verify(after)
        assert ops(after) == ["RMSNorm", "Linear", "GatedActivation", "Linear", "AllReduce", "Add"]
        down = after.nodes[3]
        assert after.values["layers.0.gate_up"].shape == (INTER, HIDDEN)  # half of gate and half of up
        assert after.values["layers.0.down"].shape == (HIDDEN, INTER // 2)
        assert after.values[after.nodes[2].outputs[0]].shape == ACT + (INTER // 2,)
        assert len(down.inputs) == (3 if rank == 0 else 2)  # the bias is added once, by rank 0
        partials.append(interpret(after, FEED))
    name = before.outputs[0].name  # x + down(...): each rank adds the residual x to its partial sum
    np.testing.assert_allclose(sum(p[name] for p in partials) - FEED["x"], whole[name], rtol=1e-5, atol=1e-5)


def test_shard_refuses_what_it_cannot_split():
    with pytest.raises(ShardError, match="num_heads 4 is not divisible by tensor_parallel 3"):
        ShardTensorParallel(3, 0).run(_fused_attention())
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        ShardTensorParallel(2, 2)
