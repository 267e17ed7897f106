"""Small IR graphs built inline (mirroring builder/trace.py's decoder, only the needed nodes) and a tiny
numpy interpreter of the IR that checks passes keep a graph's meaning: shared by the IR, verifier, pass
and quantization tests."""
from __future__ import annotations

import numpy as np

from builder.ir import Graph, Node
from builder.verifier import verify
from builder.weights import ArrayWeight
from runtime.manifest.types import Rope

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
        self.g.meta.rope = Rope(type="default", interleaved=False, attention_scaling=1.0,
                                inv_freq=tuple(float(f) for f in 1.0 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)))

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

    def head_norm(self, x: str, key: str, heads: int) -> str:  # Qwen3's q/k norm, over each head
        array = (1.0 + 0.1 * self.rng.standard_normal(HEAD_DIM)).astype(np.float32)
        weight = self.g.add_weight(key, ArrayWeight(array, label=key))
        return self.g.make("HeadRMSNorm", [x, weight], ACT + (heads * HEAD_DIM,), F32, "head_norm", eps=EPS,
                           head_dim=HEAD_DIM)

    def attention(self, h: str, layer: int, bias: bool = False, rotate: bool = True, head_norm: bool = False) -> str:
        g, p = self.g, f"layers.{layer}."
        q = self.linear(h, p + "q", HEADS * HEAD_DIM, bias=bias)
        k = self.linear(h, p + "k", KV_HEADS * HEAD_DIM, bias=bias)
        v = self.linear(h, p + "v", KV_HEADS * HEAD_DIM, bias=bias)
        if head_norm:
            q, k = self.head_norm(q, p + "q_norm", HEADS), self.head_norm(k, p + "k_norm", KV_HEADS)
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


def decoder(num_layers: int = 2, attention: bool = True, bias: bool = False, seed: int = 0,
            head_norm: bool = False) -> Graph:
    """The pre-norm decoder of trace._build_decoder; without attention, a Linear mixes tokens' features;
    `head_norm`: Qwen3's q/k norms."""
    b = Builder("decoder", seed)
    g = b.g
    g.meta.hyperparameters = {"max_position_embeddings": 128, "sliding_window": None}
    ids = g.add_input("input_ids", ACT, "int64")
    index = g.add_input("logits_index", ("num_logits",), "int64")
    x = g.make("Embedding", [ids, b.weight("embed", VOCAB, HIDDEN, scale=1.0)], ACT + (HIDDEN,), F32, "embed")
    for layer in range(num_layers):
        p = f"layers.{layer}."
        h = b.rmsnorm(x, p + "attn_norm")
        a = b.attention(h, layer, bias=bias, head_norm=head_norm) if attention else b.linear(h, p + "mix", HEADS * HEAD_DIM)
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


def attention_block(bias: bool = False, rotate: bool = True, head_norm: bool = False) -> tuple[Graph, Builder]:
    """RMSNorm -> q/k/v Linear -> [HeadRMSNorm(q), HeadRMSNorm(k) ->] Rotary(q), Rotary(k) -> Attention -> o
    Linear."""
    b = Builder("attn")
    x = b.g.add_input("x", ACT + (HIDDEN,), F32)
    h = b.rmsnorm(x, "layers.0.attn_norm")
    a = b.attention(h, 0, bias=bias, rotate=rotate, head_norm=head_norm)
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


def _rotate(x: np.ndarray, heads: int, dim: int, rope: Rope) -> np.ndarray:
    b, s, _ = x.shape
    xh = x.reshape(b, s, heads, dim)
    angles = np.arange(s)[:, None] * np.asarray(rope.inv_freq)[None, :]  # [s, dim/2]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    x1, x2 = xh[..., :dim // 2], xh[..., dim // 2:]
    out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.reshape(b, s, heads * dim).astype(np.float32)


def _attention(n: Node, env: dict, rope: Rope) -> np.ndarray:
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
        elif n.op == "HeadRMSNorm":
            dim = n.attrs["head_dim"]
            heads = ins[0].reshape(ins[0].shape[:-1] + (-1, dim))
            out = [_rms(heads, ins[1], n.attrs["eps"]).reshape(ins[0].shape)]
        elif n.op == "Split":
            out = np.split(ins[0], np.cumsum(n.attrs["sizes"])[:-1], axis=-1)
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
        elif n.op == "PermuteColumns":
            out = [ins[0][..., ins[1]]]
        elif n.op == "GatherTokens":
            out = [ins[0].reshape(-1, ins[0].shape[-1])[ins[1]]]
        elif n.op == "Rotary":
            out = [_rotate(ins[0], n.attrs["num_heads"], n.attrs["head_dim"], g.meta.rope)]
        elif n.op == "Attention":
            out = [_attention(n, env, g.meta.rope)]
        elif n.op == "AllReduce":  # one rank's view: its partial sum (a test sums the ranks' results)
            out = [ins[0]]
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
