"""IR, verifier, pass manager and every pass, on small graphs built inline.

Each pass gets Before/After tests in the style of MLC-LLM's pass tests: the exact op sequence after
the pass, the attributes it sets, the lazily fused weights, and the patterns it must leave alone.
A tiny numpy interpreter of the IR checks that the fusions keep the graph's meaning."""
from __future__ import annotations

import numpy as np
import pytest

from builder.ir import Graph, Node, Value
from builder.pass_manager import Disabled, Pass, PassError, PassManager, Phase
from builder.passes.fold_rotary import FoldRotary
from builder.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from builder.passes.fuse_gate_up import FuseGateUp
from builder.passes.fuse_qkv import FuseQKV
from builder.passes.plan_kv_cache import PlanError, PlanKVCache
from builder.passes.remove_dead_nodes import RemoveDeadNodes
from builder.pipeline import pipeline
from builder.recipe import load_recipe
from builder.verifier import VerifyError, verify
from builder.weights import ArrayWeight, Concat
from runtime.kv_spec import KVCacheSpec

F32 = "float32"
ACT = ("batch", "seq")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 16, 4, 2, 4, 24, 11
EPS = 1e-5


# ---------------------------------------------------------------------------------------------
# Graph construction helpers (mirroring builder/trace.py's _build_decoder, only the needed nodes)
# ---------------------------------------------------------------------------------------------
class Builder:
    def __init__(self, name: str = "test", seed: int = 0):
        self.g = Graph(name)
        self.rng = np.random.default_rng(seed)
        self.g.meta["rope"] = {"type": "default", "interleaved": False, "attention_scaling": 1.0,
                               "inv_freq": [float(f) for f in 1.0 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)]}

    def weight(self, name: str, *shape: int, scale: float = 0.3) -> str:
        array = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        return self.g.add_weight(name, ArrayWeight(array, label=name))

    def norm_weight(self, name: str) -> str:
        array = (1.0 + 0.1 * self.rng.standard_normal(HIDDEN)).astype(np.float32)
        return self.g.add_weight(name, ArrayWeight(array, label=name))

    def linear(self, x: str, key: str, out: int, inp: int = HIDDEN, bias: bool = False,
               shape: tuple = ACT) -> str:
        self.weight(key, out, inp)
        inputs = [x, key] + ([self.weight(key + "_bias", out)] if bias else [])
        return self.g.make("Linear", inputs, shape + (out,), F32, key.split(".")[-1])

    def rmsnorm(self, x: str, key: str) -> str:
        return self.g.make("RMSNorm", [x, self.norm_weight(key)], ACT + (HIDDEN,), F32, "norm", eps=EPS)

    def attention(self, h: str, layer: int, bias: bool = False, rotate: bool = True) -> str:
        g, p = self.g, f"layers.{layer}."
        q = self.linear(h, p + "q", HEADS * HEAD_DIM, bias=bias)
        k = self.linear(h, p + "k", KV_HEADS * HEAD_DIM, bias=bias)
        v = self.linear(h, p + "v", KV_HEADS * HEAD_DIM, bias=bias)
        if rotate:
            q = g.make("Rotary", [q], ACT + (HEADS * HEAD_DIM,), F32, "q_rot", num_heads=HEADS, head_dim=HEAD_DIM)
            k = g.make("Rotary", [k], ACT + (KV_HEADS * HEAD_DIM,), F32, "k_rot", num_heads=KV_HEADS,
                       head_dim=HEAD_DIM)
        return g.make("Attention", [q, k, v], ACT + (HEADS * HEAD_DIM,), F32, "attn", layer=layer,
                      num_heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, rotary=not rotate, packed_qkv=False)

    def mlp(self, h: str, layer: int, bias: bool = False) -> str:
        g, p = self.g, f"layers.{layer}."
        gate = g.make("Activation", [self.linear(h, p + "gate", INTER, bias=bias)], ACT + (INTER,), F32, "act",
                      fn="silu")
        m = g.make("Mul", [gate, self.linear(h, p + "up", INTER, bias=bias)], ACT + (INTER,), F32, "gated")
        return self.linear(m, p + "down", HIDDEN, inp=INTER, bias=bias)


def decoder(num_layers: int = 2, attention: bool = True, bias: bool = False, seed: int = 0) -> Graph:
    """The pre-norm decoder of trace._build_decoder; without attention, a Linear mixes tokens' features."""
    b = Builder("decoder", seed)
    g = b.g
    g.meta["hyperparameters"] = {"max_position_embeddings": 128, "sliding_window": None}
    ids = g.add_input("input_ids", ACT, "int64")
    index = g.add_input("logits_index", ("num_logits",), "int64")
    x = g.make("Embedding", [ids, b.weight("embed", VOCAB, HIDDEN, scale=1.0)], ACT + (HIDDEN,), F32, "embed")
    for layer in range(num_layers):
        p = f"layers.{layer}."
        h = b.rmsnorm(x, p + "attn_norm")
        a = b.attention(h, layer, bias=bias) if attention else b.linear(h, p + "mix", HEADS * HEAD_DIM)
        x = g.make("Add", [x, b.linear(a, p + "o", HIDDEN, inp=HEADS * HEAD_DIM)], ACT + (HIDDEN,), F32, "resid")
        h = b.rmsnorm(x, p + "mlp_norm")
        x = g.make("Add", [x, b.mlp(h, layer, bias=bias)], ACT + (HIDDEN,), F32, "resid")
    x = b.rmsnorm(x, "final_norm")
    x = g.make("GatherTokens", [x, index], ("num_logits", HIDDEN), F32, "last")
    b.weight("lm_head", VOCAB, HIDDEN)
    g.make("Linear", [x, "lm_head"], ("num_logits", VOCAB), F32, out="logits")
    g.add_output("logits")
    verify(g)
    return g


def attention_block(bias: bool = False, rotate: bool = True) -> tuple[Graph, Builder]:
    """RMSNorm -> q/k/v Linear -> Rotary(q), Rotary(k) -> Attention -> o Linear."""
    b = Builder("attn")
    x = b.g.add_input("x", ACT + (HIDDEN,), F32)
    h = b.rmsnorm(x, "layers.0.attn_norm")
    a = b.attention(h, 0, bias=bias, rotate=rotate)
    b.g.add_output(b.linear(a, "layers.0.o", HIDDEN, inp=HEADS * HEAD_DIM))
    verify(b.g)
    return b.g, b


def mlp_block(bias: bool = False) -> tuple[Graph, Builder]:
    """RMSNorm -> gate/up Linear -> silu -> Mul -> down Linear -> Add residual."""
    b = Builder("mlp")
    x = b.g.add_input("x", ACT + (HIDDEN,), F32)
    h = b.rmsnorm(x, "layers.0.mlp_norm")
    y = b.g.make("Add", [x, b.mlp(h, 0, bias=bias)], ACT + (HIDDEN,), F32, "resid")
    b.g.add_output(y)
    verify(b.g)
    return b.g, b


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.nodes]


def only(g: Graph, op: str) -> Node:
    nodes = list(g.nodes_of(op))
    assert len(nodes) == 1, f"expected one {op}, got {len(nodes)}"
    return nodes[0]


def array(g: Graph, name: str) -> np.ndarray:
    return g.weights[name].materialize()


# ---------------------------------------------------------------------------------------------
# A tiny numpy interpreter of the IR
# ---------------------------------------------------------------------------------------------
def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * w).astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


ACTIVATIONS = {"silu": _silu}


def _rotate(x: np.ndarray, heads: int, dim: int, rope: dict) -> np.ndarray:
    b, s, _ = x.shape
    xh = x.reshape(b, s, heads, dim)
    angles = np.arange(s)[:, None] * np.asarray(rope["inv_freq"])[None, :]  # [s, dim/2]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    x1, x2 = xh[..., :dim // 2], xh[..., dim // 2:]
    out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.reshape(b, s, heads * dim).astype(np.float32)


def _attention(n: Node, env: dict, rope: dict) -> np.ndarray:
    a = n.attrs
    heads, kv_heads, dim = a["num_heads"], a["kv_heads"], a["head_dim"]
    if a["packed_qkv"]:
        packed = env[n.inputs[0]]
        q, k, v = np.split(packed, [heads * dim, (heads + kv_heads) * dim], axis=-1)
    else:
        q, k, v = (env[i] for i in n.inputs)
    if a["rotary"]:
        q, k = _rotate(q, heads, dim, rope), _rotate(k, kv_heads, dim, rope)
    b, s, _ = q.shape
    q = q.reshape(b, s, heads, dim).transpose(0, 2, 1, 3)
    k = np.repeat(k.reshape(b, s, kv_heads, dim).transpose(0, 2, 1, 3), heads // kv_heads, axis=1)
    v = np.repeat(v.reshape(b, s, kv_heads, dim).transpose(0, 2, 1, 3), heads // kv_heads, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dim)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(b, s, heads * dim).astype(np.float32)


def interpret(g: Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate the graph on numpy inputs; returns the graph outputs by name."""
    env = dict(feeds)
    env.update({name: w.materialize() for name, w in g.weights.items()})
    for n in g.nodes:
        ins = [env[i] if i else None for i in n.inputs]
        if n.op == "Embedding":
            out = [ins[1][ins[0]]]
        elif n.op == "RMSNorm":
            out = [_rms(ins[0], ins[1], n.attrs["eps"])]
        elif n.op == "SkipRMSNorm":
            total = ins[0] + ins[1]
            out = [_rms(total, ins[2], n.attrs["eps"]), total]
        elif n.op == "Linear":
            y = ins[0] @ ins[1].T
            out = [y + ins[2] if len(ins) == 3 and ins[2] is not None else y]
        elif n.op == "Activation":
            out = [ACTIVATIONS[n.attrs["fn"]](ins[0])]
        elif n.op == "GatedActivation":
            gate, up = np.split(ins[0], 2, axis=-1)
            out = [ACTIVATIONS[n.attrs["fn"]](gate) * up]
        elif n.op == "Add":
            out = [ins[0] + ins[1]]
        elif n.op == "Mul":
            out = [ins[0] * ins[1]]
        elif n.op == "GatherTokens":
            out = [ins[0].reshape(-1, ins[0].shape[-1])[ins[1]]]
        elif n.op == "Rotary":
            out = [_rotate(ins[0], n.attrs["num_heads"], n.attrs["head_dim"], g.meta["rope"])]
        elif n.op == "Attention":
            out = [_attention(n, env, g.meta["rope"])]
        else:
            raise NotImplementedError(n.op)
        assert len(out) == len(n.outputs)
        env.update(zip(n.outputs, out))
    return {o.name: env[o.name] for o in g.outputs}


def decoder_feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(2, 5)).astype(np.int64)
    return {"input_ids": ids, "logits_index": np.array([4, 9, 0], dtype=np.int64)}


def assert_same_outputs(before: Graph, after: Graph, feeds: dict[str, np.ndarray]) -> None:
    expected, actual = interpret(before, feeds), interpret(after, feeds)
    assert expected.keys() == actual.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_interpreter_sanity():
    g, _ = mlp_block()
    x = np.random.default_rng(1).standard_normal((2, 3, HIDDEN)).astype(np.float32)
    (y,) = interpret(g, {"x": x}).values()
    w = {k: v.materialize() for k, v in g.weights.items()}
    h = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + EPS) * w["layers.0.mlp_norm"]
    gate, up = h @ w["layers.0.gate"].T, h @ w["layers.0.up"].T
    expected = x + (gate / (1 + np.exp(-gate)) * up) @ w["layers.0.down"].T
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# IR basics and text form
# ---------------------------------------------------------------------------------------------
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
    c.meta["new"] = 1
    assert g.text() == text


@pytest.mark.parametrize("make_pass", [FoldRotary, FuseQKV, FuseGateUp, FuseAddRMSNorm, RemoveDeadNodes,
                                       lambda: PlanKVCache(2, 16, F32)])
def test_passes_do_not_mutate_their_input(make_pass):
    g = FoldRotary().run(decoder()) if make_pass is FuseQKV else decoder()
    text, weights, values = g.text(), dict(g.weights), dict(g.values)
    verify(make_pass().run(g))
    assert g.text() == text and g.weights == weights and g.values == values


# ---------------------------------------------------------------------------------------------
# Verifier
# ---------------------------------------------------------------------------------------------
def small() -> Graph:
    g = Graph("t")
    x = g.add_input("x", ("n", 4), F32)
    g.add_weight("w", ArrayWeight(np.ones((4, 4), np.float32), "w"))
    y = g.make("Linear", [x, "w"], ("n", 4), F32, out="y")
    g.add_output(y)
    verify(g)
    return g


def test_verifier_rejects_unknown_op():
    g = small()
    g.make("Softmax", ["y"], ("n", 4), F32, out="z")
    with pytest.raises(VerifyError, match="unknown op 'Softmax'.*known: .*'Linear'"):
        verify(g)


@pytest.mark.parametrize("op, inputs, message", [
    ("Linear", ["x"], "Linear takes 2..3 inputs, got 1"),
    ("Linear", ["x", "w", "w", "w"], "Linear takes 2..3 inputs, got 4"),
    ("Add", ["x", "x", "x"], "Add takes 2..2 inputs, got 3"),
])
def test_verifier_rejects_wrong_arity(op, inputs, message):
    g = small()
    g.make(op, inputs, ("n", 4), F32)
    with pytest.raises(VerifyError, match=message):
        verify(g)


def test_verifier_accepts_absent_optional_input():
    g = small()
    g.make("Linear", ["x", "w", ""], ("n", 4), F32)
    verify(g)


def test_verifier_rejects_wrong_output_count_and_missing_attrs():
    g = small()
    g.make("SkipRMSNorm", ["x", "x", "w"], ("n", 4), F32, eps=1e-5)
    with pytest.raises(VerifyError, match="SkipRMSNorm has 2 outputs, got 1"):
        verify(g)
    g = small()
    g.make("RMSNorm", ["x", "w"], ("n", 4), F32)
    with pytest.raises(VerifyError, match=r"RMSNorm lacks attributes \['eps'\]"):
        verify(g)


def test_verifier_rejects_use_before_definition():
    g = small()
    g.make("Add", ["y", "later"], ("n", 4), F32)
    g.make("Add", ["y", "y"], ("n", 4), F32, out="later")
    with pytest.raises(VerifyError, match="input 'later' is used before it is defined"):
        verify(g)


@pytest.mark.parametrize("name", ["y", "x", "w"])
def test_verifier_rejects_double_definition(name):
    g = small()
    g.nodes.append(Node("Add", ["y", "y"], [name], {}, "dup"))
    with pytest.raises(VerifyError, match=f"dup: value '{name}' is defined twice"):
        verify(g)


def test_verifier_rejects_uncomputed_output_and_weight_shape_mismatch():
    g = small()
    g.nodes.clear()
    with pytest.raises(VerifyError, match="graph output 'y' is never computed"):
        verify(g)
    g = small()
    g.values["w"] = Value("w", (4, 5), F32)
    with pytest.raises(VerifyError, match=r"weight 'w': value shape \(4, 5\) != source \(4, 4\)"):
        verify(g)
    g = small()
    g.nodes.append(Node("Add", ["y", "y"], ["ghost"], {}, "noval"))
    with pytest.raises(VerifyError, match="output 'ghost' has no Value"):
        verify(g)


# ---------------------------------------------------------------------------------------------
# FoldRotary
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# FuseQKV
# ---------------------------------------------------------------------------------------------
QKV_WIDTH = (HEADS + 2 * KV_HEADS) * HEAD_DIM


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


def _fold_then_qkv(g: Graph) -> Graph:
    verify(g)
    before = FoldRotary().run(g)
    after = FuseQKV().run(before)
    verify(after)
    assert ops(after) == ops(before)
    assert only(after, "Attention").attrs["packed_qkv"] is False
    assert "layers.0.qkv" not in after.weights
    return after


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


def test_fuse_qkv_leaves_unfolded_rotary_alone():
    g, _ = attention_block()
    after = FuseQKV().run(g)
    assert ops(after) == ops(g) and "layers.0.qkv" not in after.weights


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


# ---------------------------------------------------------------------------------------------
# FuseGateUp
# ---------------------------------------------------------------------------------------------
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


def _gate_up_unchanged(g: Graph) -> None:
    verify(g)
    after = FuseGateUp().run(g)
    verify(after)
    assert ops(after) == ops(g) and "layers.0.gate_up" not in after.weights


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


# ---------------------------------------------------------------------------------------------
# FuseAddRMSNorm
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# RemoveDeadNodes
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# PlanKVCache
# ---------------------------------------------------------------------------------------------
BYTES_PER_SLOT_F32 = 2 * 2 * KV_HEADS * 64 * HEAD_DIM * 4  # K and V, 2 layers, max_seq_len 64


def test_plan_kv_cache_computes_slots_and_bytes():
    g = decoder()
    after = PlanKVCache(max_batch_size=4, max_seq_len=64, dtype=F32).run(g)
    spec = after.meta["kv_cache"]
    assert spec == KVCacheSpec(num_layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=F32, slots=4,
                               max_seq_len=64)
    assert spec.buffer_shape == (4, KV_HEADS, 64, HEAD_DIM)
    assert spec.bytes_per_slot == BYTES_PER_SLOT_F32 and spec.bytes == 4 * BYTES_PER_SLOT_F32
    assert spec.to_dict()["bytes"] == spec.bytes
    assert "kv_cache" not in g.meta  # planned on a copy
    half = PlanKVCache(4, 64, "float16").run(g).meta["kv_cache"]
    assert half.dtype == "float16" and half.bytes == spec.bytes // 2
    assert ops(after) == ops(g)


@pytest.mark.parametrize("budget_slots, expected", [(2, 2), (2.5, 2), (4, 4), (100, 4)])
def test_plan_kv_cache_fits_memory_budget(budget_slots, expected):
    budget_mb = budget_slots * BYTES_PER_SLOT_F32 / 2**20
    spec = PlanKVCache(4, 64, F32, memory_budget_mb=budget_mb).run(decoder()).meta["kv_cache"]
    assert spec.slots == expected and spec.max_seq_len == 64
    assert spec.bytes <= budget_mb * 2**20


def test_plan_kv_cache_budget_without_a_slot_is_an_error():
    budget_mb = 0.5 * BYTES_PER_SLOT_F32 / 2**20
    with pytest.raises(PlanError, match=f"kv_memory_budget_mb {budget_mb} holds no sequence of max_seq_len 64"):
        PlanKVCache(4, 64, F32, memory_budget_mb=budget_mb).run(decoder())
    with pytest.raises(PlanError, match="holds no sequence"):
        PlanKVCache(4, 64, F32, memory_budget_mb=0).run(decoder())


@pytest.mark.parametrize("hp, message", [
    ({"sliding_window": 32}, "max_seq_len 64 exceeds the model's sliding window 32.*use max_seq_len <= 32"),
    ({"max_position_embeddings": 48}, "max_seq_len 64 exceeds the model's max_position_embeddings 48.*<= 48"),
    ({"sliding_window": 100, "max_position_embeddings": 48}, "max_position_embeddings 48"),
])
def test_plan_kv_cache_refuses_too_long_max_seq_len(hp, message):
    g = decoder()
    g.meta["hyperparameters"] = hp
    with pytest.raises(PlanError, match=message):
        PlanKVCache(4, 64, F32).run(g)


def test_plan_kv_cache_accepts_limits_equal_to_model_caps():
    g = decoder()
    g.meta["hyperparameters"] = {"sliding_window": 64, "max_position_embeddings": 64}
    assert PlanKVCache(4, 64, F32).run(g).meta["kv_cache"].max_seq_len == 64
    del g.meta["hyperparameters"]
    assert PlanKVCache(4, 64, F32).run(g).meta["kv_cache"].max_seq_len == 64


def test_plan_kv_cache_structural_errors():
    g, _ = mlp_block()
    with pytest.raises(PlanError, match="no Attention node"):
        PlanKVCache(1, 8, F32).run(g)
    g = decoder()
    list(g.nodes_of("Attention"))[1].attrs["kv_heads"] = 1
    with pytest.raises(PlanError, match="disagree on \\(kv_heads, head_dim\\)"):
        PlanKVCache(1, 8, F32).run(g)
    g = decoder()
    list(g.nodes_of("Attention"))[1].attrs["layer"] = 5
    with pytest.raises(PlanError, match=r"must be 0..1, got \[0, 5\]"):
        PlanKVCache(1, 8, F32).run(g)


# ---------------------------------------------------------------------------------------------
# PassManager and pipeline
# ---------------------------------------------------------------------------------------------
class Boom(Pass):
    name = "boom"

    def run(self, graph: Graph) -> Graph:
        raise RuntimeError("kaboom")


class Breaks(Pass):
    name = "breaks_graph"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        g.nodes.append(Node("Frobnicate", [], ["f"], {}, "frob"))
        return g


def test_pass_manager_wraps_failure_with_pass_and_history():
    manager = PassManager([Phase("fusion", [FoldRotary(), Disabled("fuse_qkv")]), Phase("late", [Boom()])])
    with pytest.raises(PassError) as info:
        manager.run(decoder())
    message = str(info.value)
    assert "pass 'boom' (phase late) failed: kaboom" in message
    assert "passes run before it: ['fold_rotary', 'fuse_qkv']" in message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_pass_manager_first_pass_failure_and_verifier_failure():
    with pytest.raises(PassError, match="pass 'boom' .*passes run before it: none"):
        PassManager([Phase("p", [Boom()])]).run(decoder())
    with pytest.raises(PassError, match="pass 'breaks_graph' \\(phase p\\) failed: .*unknown op 'Frobnicate'") \
            as info:
        PassManager([Phase("p", [FoldRotary(), Breaks()])]).run(decoder())
    assert isinstance(info.value.__cause__, VerifyError)


def test_pass_manager_verifies_input_graph():
    g = decoder()
    g.nodes.reverse()
    with pytest.raises(VerifyError, match="used before it is defined"):
        PassManager([Phase("p", [])]).run(g)


def test_disabled_pass_is_a_noop_listed_in_timings():
    g = decoder()
    disabled = Disabled("fuse_qkv")
    assert disabled.run(g) is g and disabled.name == "fuse_qkv" and disabled.why == "disabled by the recipe"
    manager = PassManager([Phase("fusion", [FoldRotary(), disabled, FuseGateUp()])])
    out = manager.run(g)
    assert [(t.phase, t.name, t.disabled) for t in manager.timings] == [
        ("fusion", "fold_rotary", False), ("fusion", "fuse_qkv", True), ("fusion", "fuse_gate_up", False)]
    assert all(t.seconds >= 0 for t in manager.timings)
    assert [t.nodes_after for t in manager.timings] == [len(g.nodes) - 4, len(g.nodes) - 4, len(out.nodes)]
    assert "Attention" in ops(out) and all(n.attrs["packed_qkv"] is False for n in out.nodes_of("Attention"))


def test_dump_dir_gets_before_and_after_each_phase(tmp_path):
    recipe = load_recipe(base={"model": "unused"}, overrides=["limits.max_seq_len=64", "limits.max_batch_size=2"])
    manager = PassManager(pipeline(recipe), tmp_path / "ir")
    out = manager.run(decoder())
    names = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert names == sorted(f"{i:02d}-{when}-{phase}.ir" for i, phase in
                           enumerate(["fusion", "quantization", "layout", "cleanup"]) for when in ("before", "after"))
    before = (tmp_path / "ir" / "00-before-fusion.ir").read_text()
    after = (tmp_path / "ir" / "00-after-fusion.ir").read_text()
    assert "Rotary(" in before and "concat(" not in before
    assert "concat(" in after and "Rotary(" not in after and "SkipRMSNorm(" in after
    assert "meta kv_cache" in (tmp_path / "ir" / "02-after-layout.ir").read_text()
    assert (tmp_path / "ir" / "03-after-cleanup.ir").read_text() == out.text()
    assert out.meta["kv_cache"].slots == 2


def test_pipeline_lists_every_pass_and_disables_by_recipe():
    recipe = load_recipe(base={"model": "m"}, overrides=["passes.fuse_qkv=false", "passes.fuse_add_rmsnorm=false",
                                                                "limits.max_seq_len=64", "sampling_head.enabled=false"])
    phases = pipeline(recipe)
    assert [p.name for p in phases] == ["fusion", "quantization", "layout", "cleanup"]
    listed = [(p.name, isinstance(p, Disabled)) for phase in phases for p in phase.passes]
    assert listed == [("fold_rotary", False), ("fuse_qkv", True), ("fuse_gate_up", False),
                      ("fuse_add_rmsnorm", True), ("append_sampling_head", True), ("search_awq_scales", True),
                      ("quantize_weights", True), ("plan_kv_cache", False), ("plan_cuda_graphs", True),
                      ("remove_dead_nodes", False)]
    out = PassManager(phases).run(decoder())
    assert "SkipRMSNorm" not in ops(out) and "GatedActivation" in ops(out)
    assert all(not n.attrs["packed_qkv"] and n.attrs["rotary"] for n in out.nodes_of("Attention"))
    assert_same_outputs(decoder(), out, decoder_feeds())


# ---------------------------------------------------------------------------------------------
# Regressions: bugs found by these tests and fixed
# ---------------------------------------------------------------------------------------------
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


def test_regression_fuse_gate_up_same_weight_for_gate_and_up():
    g, _ = mlp_block()
    up = next(n for n in g.nodes if n.inputs[1:2] == ["layers.0.up"])
    up.inputs[1] = "layers.0.gate"
    verify(g)
    verify(FuseGateUp().run(g))


def test_regression_fusion_removes_value_that_is_a_graph_output():
    g, _ = attention_block(rotate=False)
    k = only(g, "Attention").inputs[1]
    g.add_output(k)
    verify(g)
    verify(FuseQKV().run(g))


def test_regression_concat_dtype_follows_parts():
    parts = [ArrayWeight(np.ones((2, 2), np.float16)), ArrayWeight(np.ones((2, 2), np.float16))]
    assert Concat(parts).dtype == Concat(parts).materialize().dtype.name == "float16"
