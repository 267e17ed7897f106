"""IR: values, weights (lazy Concat), text, copies; the test interpreter itself.

Split from the former tests/test_ir_and_passes.py; graphs and the numpy interpreter of the IR
are in tests/graph_helpers.py."""
from __future__ import annotations

import numpy as np
import pytest

from builder.ir import Graph, Value
from builder.passes.fold_rotary import FoldRotary
from builder.passes.fuse_qkv import FuseQKV
from builder.weights import ArrayWeight, Concat
from graph_helpers import EPS, F32, HEADS, HEAD_DIM, HIDDEN, KV_HEADS, attention_block, decoder, interpret, mlp_block


def test_interpreter_sanity():
    g, _ = mlp_block()
    x = np.random.default_rng(1).standard_normal((2, 3, HIDDEN)).astype(np.float32)
    (y,) = interpret(g, {"x": x}).values()
    w = {k: v.materialize() for k, v in g.weights.items()}
    h = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + EPS) * w["layers.0.mlp_norm"]
    gate, up = h @ w["layers.0.gate"].T, h @ w["layers.0.up"].T
    expected = x + (gate / (1 + np.exp(-gate)) * up) @ w["layers.0.down"].T
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_make_registers_values_with_fresh_names():
    g = Graph("t")
    x = g.add_input("x", ("n", 4), F32)
    a = g.make("Add", [x, x], ("n", 4), F32)
    b = g.make("Add", [a, x], ("n", 4), F32, "resid")
    c = g.make("Add", [b, x], ("n", 4), F32, out="named")
    assert len({a, b, c}) == 3 and b.startswith("resid.") and c == "named"
    assert g.values[c] == Value("named", ("n", 4), F32)
    assert [n.inputs for n in g.nodes] == [[x, x], [a, x], [b, x]]
    assert len({n.name for n in g.nodes}) == 3


def test_value_and_weight_validation():
    with pytest.raises(ValueError, match="dtype 'float64'"):
        Value("x", (1,), "float64")
    g = Graph("t")
    g.add_weight("w", ArrayWeight(np.zeros((2, 3), np.float32)))
    assert g.values["w"].shape == (2, 3) and g.num_parameters() == 6
    with pytest.raises(ValueError, match="already defined"):
        g.add_weight("w", ArrayWeight(np.zeros((2, 3), np.float32)))
    with pytest.raises(ValueError, match="float64"):  # numpy's default dtype is not an IR dtype
        g.add_weight("w64", ArrayWeight(np.zeros(3)))


def test_concat_is_lazy_and_joins_along_axis():
    calls = []

    class Counting(ArrayWeight):
        def materialize(self):
            calls.append(self.label)
            return super().materialize()

    a = Counting(np.arange(6, dtype=np.float32).reshape(2, 3), "a")
    b = Counting(np.arange(9, dtype=np.float32).reshape(3, 3), "b")
    c = Concat([a, b])
    assert c.shape == (5, 3) and calls == []
    np.testing.assert_array_equal(c.materialize(), np.concatenate([a.array, b.array]))
    assert calls == ["a", "b"]
    d = Concat([a, Counting(np.ones((2, 1), np.float32), "c")], axis=1)
    assert d.shape == (2, 4) and str(d) == "concat(a[2, 3], c[2, 1], axis=1)"


def test_text_lists_inputs_meta_weights_nodes_and_outputs():
    g, _ = attention_block()
    text = g.text()
    assert text.startswith(f"graph attn(%x: float32[batch, seq, {HIDDEN}])\n")
    assert "  meta rope = {" in text
    assert f"  weight %layers.0.q: float32[{HEADS * HEAD_DIM}, {HIDDEN}] = layers.0.q[{HEADS * HEAD_DIM}, {HIDDEN}]" \
        in text
    assert "Rotary(%" in text and "num_heads=4, head_dim=4" in text
    assert "rotary=False, packed_qkv=False" in text
    assert text.rstrip().splitlines()[-1] == f"  return %{g.outputs[0].name}"

    fused = FuseQKV().run(FoldRotary().run(g))
    text = fused.text()
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    assert (f"  weight %layers.0.qkv: float32[{width}, {HIDDEN}] = concat(layers.0.q[{HEADS * HEAD_DIM}, {HIDDEN}], "
            f"layers.0.k[{KV_HEADS * HEAD_DIM}, {HIDDEN}], layers.0.v[{KV_HEADS * HEAD_DIM}, {HIDDEN}], axis=0)") \
        in text
    attn_line = next(line for line in text.splitlines() if "Attention(" in line)
    assert ", _, _, layer=0" in attn_line  # absent optional inputs print as _
    assert "rotary=True, packed_qkv=True" in attn_line


def test_copy_is_independent():
    g = decoder()
    text = g.text()
    c = g.copy()
    c.nodes[0].inputs[0] = "other"
    c.nodes[0].attrs["x"] = 1
    c.nodes.pop()
    c.weights.pop("embed")
    c.meta.family = "new"
    assert g.text() == text


def test_regression_concat_dtype_follows_parts():
    parts = [ArrayWeight(np.ones((2, 2), np.float16)), ArrayWeight(np.ones((2, 2), np.float16))]
    assert Concat(parts).dtype == Concat(parts).materialize().dtype.name == "float16"
