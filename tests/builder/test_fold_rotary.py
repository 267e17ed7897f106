"""fold_rotary: before/after, the patterns it leaves alone, semantics.

Split from the former tests/test_ir_and_passes.py; graphs and the numpy interpreter of the IR
are in tests/graph_helpers.py."""
from __future__ import annotations

from builder.passes.fold_rotary import FoldRotary
from builder.verifier import verify
from graph_helpers import (ACT, F32, HEADS, HEAD_DIM, KV_HEADS, assert_same_outputs, attention_block, decoder,
                           decoder_feeds, only, ops)


def test_fold_rotary_before_after():
    before, _ = attention_block()
    assert ops(before) == ["RMSNorm", "Linear", "Linear", "Linear", "Rotary", "Rotary", "Attention", "Linear"]
    after = FoldRotary().run(before)
    verify(after)
    assert ops(after) == ["RMSNorm", "Linear", "Linear", "Linear", "Attention", "Linear"]
    attn = only(after, "Attention")
    q, k, v = (n.outputs[0] for n in list(after.nodes_of("Linear"))[:3])
    assert attn.inputs == [q, k, v]
    assert attn.attrs["rotary"] is True and attn.attrs["packed_qkv"] is False
    assert attn.attrs["num_heads"] == HEADS and attn.attrs["kv_heads"] == KV_HEADS


def test_fold_rotary_keeps_rotary_used_twice():
    before, _ = attention_block()
    q_rot = list(before.nodes_of("Rotary"))[0].outputs[0]
    extra = before.make("Add", [q_rot, q_rot], ACT + (HEADS * HEAD_DIM,), F32)
    before.add_output(extra)
    after = FoldRotary().run(before)
    verify(after)
    assert ops(after) == ops(before)
    assert only(after, "Attention").attrs["rotary"] is False


def test_fold_rotary_needs_both_q_and_k_rotated():
    before, _ = attention_block(rotate=False)
    attn = only(before, "Attention")
    attn.attrs["rotary"] = False
    q = attn.inputs[0]
    attn.inputs[0] = before.make("Rotary", [q], ACT + (HEADS * HEAD_DIM,), F32, num_heads=HEADS, head_dim=HEAD_DIM)
    before.nodes.insert(before.nodes.index(attn), before.nodes.pop())
    verify(before)
    after = FoldRotary().run(before)
    assert ops(after) == ["RMSNorm", "Linear", "Linear", "Linear", "Rotary", "Attention", "Linear"]
    assert only(after, "Attention").attrs["rotary"] is False


def test_fold_rotary_skips_already_rotary_attention():
    before, _ = attention_block(rotate=False)
    assert only(before, "Attention").attrs["rotary"] is True
    after = FoldRotary().run(before)
    assert after.text() == before.text()


def test_fold_rotary_preserves_semantics():
    g = decoder()
    assert_same_outputs(g, FoldRotary().run(g), decoder_feeds())


def test_fold_rotary_passes_a_layer_table_on():
    """Rotary nodes naming their layer's own table (Gemma 3's sliding layers) fold into an Attention that
    names it; q and k with different tables are left unfolded."""
    before, _ = attention_block()
    for rotary in before.nodes_of("Rotary"):
        rotary.attrs["table"] = "sliding_attention"
    after = FoldRotary().run(before)
    verify(after)
    assert ops(after) == ["RMSNorm", "Linear", "Linear", "Linear", "Attention", "Linear"]
    assert only(after, "Attention").attrs["table"] == "sliding_attention"
    assert "table" not in only(FoldRotary().run(attention_block()[0]), "Attention").attrs
    mixed, _ = attention_block()
    list(mixed.nodes_of("Rotary"))[0].attrs["table"] = "sliding_attention"
    assert ops(FoldRotary().run(mixed)) == ops(mixed)
