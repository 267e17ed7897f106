"""fuse_gate_up: before/after, the patterns it leaves alone, semantics, regressions.

Split from the former tests/test_ir_and_passes.py; graphs and the numpy interpreter of the IR
are in tests/graph_helpers.py."""
from __future__ import annotations

import numpy as np
import pytest

from builder.ir import Graph
from builder.passes.fuse_gate_up import FuseGateUp
from builder.verifier import verify
from graph_helpers import (ACT, F32, HIDDEN, INTER, array, assert_same_outputs, decoder, decoder_feeds, mlp_block,
                           only, ops)


@pytest.mark.parametrize("bias", [False, True])
def test_fuse_gate_up_before_after(bias):
    before, _ = mlp_block(bias=bias)
    assert ops(before) == ["RMSNorm", "Linear", "Activation", "Linear", "Mul", "Linear", "Add"]
    mul_out = only(before, "Mul").outputs[0]
    originals = {name: array(before, name) for name in before.weights}
    after = FuseGateUp().run(before)
    verify(after)
    assert ops(after) == ["RMSNorm", "Linear", "GatedActivation", "Linear", "Add"]
    norm, gate_up, gated, down, add = after.nodes
    assert gate_up.inputs == [norm.outputs[0], "layers.0.gate_up"] + (["layers.0.gate_up_bias"] if bias else [])
    assert gated.inputs == gate_up.outputs and gated.attrs == {"fn": "silu"}
    assert gated.outputs == [mul_out] and down.inputs[0] == mul_out  # the down projection is untouched
    assert after.values[gate_up.outputs[0]].shape == ACT + (2 * INTER,)
    assert after.values["layers.0.gate_up"].shape == (2 * INTER, HIDDEN)
    np.testing.assert_array_equal(array(after, "layers.0.gate_up"),
                                  np.concatenate([originals["layers.0.gate"], originals["layers.0.up"]]))
    if bias:
        np.testing.assert_array_equal(array(after, "layers.0.gate_up_bias"), np.concatenate(
            [originals["layers.0.gate_bias"], originals["layers.0.up_bias"]]))
    gone = {f"layers.0.{p}{s}" for p in ("gate", "up") for s in ("", "_bias")}
    assert not gone & set(after.weights) and not gone & set(after.values)


def test_fuse_gate_up_leaves_activation_with_second_consumer():
    g, _ = mlp_block()
    act = only(g, "Activation").outputs[0]
    g.add_output(g.make("Add", [act, act], ACT + (INTER,), F32))
    _gate_up_unchanged(g)


@pytest.mark.parametrize("which", ["gate", "up"])
def test_fuse_gate_up_leaves_linear_with_second_consumer(which):
    g, _ = mlp_block()
    lin = next(n for n in g.nodes if n.inputs[1:2] == [f"layers.0.{which}"]).outputs[0]
    g.add_output(g.make("Add", [lin, lin], ACT + (INTER,), F32))
    _gate_up_unchanged(g)


def test_fuse_gate_up_leaves_different_inputs():
    g, _ = mlp_block()
    up = next(n for n in g.nodes if n.inputs[1:2] == ["layers.0.up"])
    up.inputs[0] = "x"
    _gate_up_unchanged(g)


def test_fuse_gate_up_leaves_bias_on_only_one_projection():
    g, b = mlp_block()
    up = next(n for n in g.nodes if n.inputs[1:2] == ["layers.0.up"])
    up.inputs.append(b.weight("layers.0.up_bias", INTER))
    _gate_up_unchanged(g)


def test_fuse_gate_up_leaves_mul_without_activation():
    g, _ = mlp_block()
    act = only(g, "Activation")
    g.replace_uses(act.outputs[0], act.inputs[0])
    g.nodes.remove(act)
    _gate_up_unchanged(g)


@pytest.mark.parametrize("bias", [False, True])
def test_fuse_gate_up_preserves_semantics(bias):
    g = decoder(attention=False, bias=bias)
    after = FuseGateUp().run(g)
    verify(after)
    assert ops(after).count("GatedActivation") == 2 and "Mul" not in ops(after)
    assert_same_outputs(g, after, decoder_feeds(1))


def _gate_up_unchanged(g: Graph) -> None:
    verify(g)
    after = FuseGateUp().run(g)
    verify(after)
    assert ops(after) == ops(g) and "layers.0.gate_up" not in after.weights


def test_regression_fuse_gate_up_same_weight_for_gate_and_up():
    g, _ = mlp_block()
    up = next(n for n in g.nodes if n.inputs[1:2] == ["layers.0.up"])
    up.inputs[1] = "layers.0.gate"
    verify(g)
    verify(FuseGateUp().run(g))
