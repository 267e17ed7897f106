"""permute_activations: before/after on a small decoder whose linears are stored with permuted input
columns (GPTQ desc_act), the shared permutation, and what it leaves to the fusions."""
from __future__ import annotations

import numpy as np
import pytest

from builder.passes.fold_rotary import FoldRotary
from builder.passes.fuse_qkv import FuseQKV
from builder.passes.permute_activations import PermuteActivations
from builder.passes.shard_tensor_parallel import ShardError, ShardTensorParallel
from builder.quant.schemes import quantize
from builder.quant.weights import PermutedColumns, Prequantized, exact_arrays, prequantized_layout
from builder.verifier import verify
from graph_helpers import assert_same_outputs, decoder, decoder_feeds, ops


def stored_permuted(g, name: str, order: np.ndarray) -> None:
    """Replace weight `name` by its int4 arrays with columns stored in `order`."""
    w = g.weights[name].materialize()
    arrays = quantize(w[:, order], 4, 16, symmetric=False)
    g.weights[name] = Prequantized(lambda: arrays, 4, 16, *w.shape, False, key=name, order=order)


def desc_act_decoder():
    """Layer 0: q/k/v share one order, gate/up one; layer 1: k has its own; o and down their own."""
    g = decoder(num_layers=2)
    rng = np.random.default_rng(1)
    for layer in range(2):
        p = f"layers.{layer}."
        qkv, gate_up = rng.permutation(16), rng.permutation(16)
        for kind, order in (("q", qkv), ("k", qkv if layer == 0 else rng.permutation(16)), ("v", qkv),
                            ("gate", gate_up), ("up", gate_up), ("o", rng.permutation(16)),
                            ("down", rng.permutation(24))):
            stored_permuted(g, p + kind, order)
    return g


def test_permute_activations_before_after():
    before = desc_act_decoder()
    after = PermuteActivations().run(before)
    verify(after)
    permutes = [n for n in after.nodes if n.op == "PermuteColumns"]
    assert len(permutes) == 4 + 5  # layer 0: qkv, o, gate_up, down; layer 1: q/v, k, o, gate_up, down
    linears = {n.inputs[1]: n for n in after.nodes if n.op == "Linear"}
    assert linears["layers.0.q"].inputs[0] == linears["layers.0.k"].inputs[0] == linears["layers.0.v"].inputs[0]
    assert linears["layers.1.q"].inputs[0] == linears["layers.1.v"].inputs[0] != linears["layers.1.k"].inputs[0]
    for n in permutes:  # just before its first reader
        assert after.nodes[after.nodes.index(n) + 1].inputs[0] == n.outputs[0]
    q = after.weights["layers.0.q"]
    assert isinstance(q, PermutedColumns) and exact_arrays(q, 4, 16, False) is not None
    assert_same_outputs(before, after, decoder_feeds())
    assert ops(after)[-1] == "Linear" and "lm_head" in after.weights  # float weights untouched


def test_shared_orders_stay_fusable():
    fused = FuseQKV().run(PermuteActivations().run(FoldRotary().run(desc_act_decoder())))
    assert "layers.0.qkv" in fused.weights and "layers.1.qkv" not in fused.weights
    assert prequantized_layout(fused.weights["layers.0.qkv"]) == (4, 16, False)


def test_a_permuted_weight_is_not_used_unpermuted():
    g = desc_act_decoder()
    with pytest.raises(ValueError, match="stored permuted .*permute_activations"):
        prequantized_layout(g.weights["layers.0.q"])


def test_tensor_parallel_refuses_permuted_inputs():
    g = PermuteActivations().run(desc_act_decoder())
    with pytest.raises(ShardError, match="desc_act"):
        ShardTensorParallel(2, 0).run(g)
