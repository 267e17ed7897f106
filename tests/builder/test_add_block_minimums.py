"""AddBlockMinimums Before/After on a small IR of GGUF weights with block minimums (Q4_1, Q4_K), and the same
term evaluated in numpy against the file's dequantized weight."""
from __future__ import annotations

import numpy as np
import pytest

from builder.gguf.checkpoint import GGUFWeight
from builder.gguf.repack import BLOCK_TYPES, repack, symmetric_layout
from builder.ir import Graph
from builder.passes.add_block_minimums import AddBlockMinimums
from builder.quant.schemes import QuantizedArrays, dequantize
from builder.quant.weights import QuantizedWeight, Quantizer
from builder.verifier import verify
from gguf_files import encode

F32 = "float32"
K = 256


def gguf_weight(type_name: str, n: int, seed: int) -> GGUFWeight:
    """A [n, K] weight in `type_name`'s bytes (gguf's quantizer or random K-quant blocks), repacked."""
    rng = np.random.default_rng(seed)
    data = encode(rng.standard_normal((n, K)).astype(np.float32) * 0.05, type_name, rng)
    arrays, mins = repack(type_name, data, n, K)
    kind = BLOCK_TYPES[type_name]
    return GGUFWeight(lambda: arrays, kind.bits, kind.block, n, K, symmetric_layout(type_name, data), key=type_name,
                      minimums=None if mins is None else (lambda: mins))


def quant_linear(g: Graph, x: str, name: str, source: GGUFWeight) -> str:
    quantizer = Quantizer(source, source.bits, source.block, source.symmetric)
    inputs = [x] + [g.add_weight(f"{name}.{part}", QuantizedWeight(quantizer, part)) for part in quantizer.parts()]
    return g.make("QuantLinear", inputs, ("batch", "seq", source.n), F32, bits=source.bits,
                  block_size=source.block, K=K, N=source.n, accuracy_level=4)


def graph(types: dict[str, str]) -> tuple[Graph, dict[str, GGUFWeight]]:
    """q, k, v linears on x (`types` each), q + k; every linear's output is a graph output too."""
    g = Graph("m")
    x = g.add_input("x", ("batch", "seq", K), F32)
    sources = {name: gguf_weight(t, 96, seed) for seed, (name, t) in enumerate(types.items())}
    outs = {name: quant_linear(g, x, f"layers.0.{name}", sources[name]) for name in ("q", "k", "v")}
    g.make("Add", [outs["q"], outs["k"]], ("batch", "seq", 96), F32, out="qk")
    g.add_output("qk")
    for name in ("q", "k", "v"):
        g.add_output(outs[name])
    return g, sources


def evaluate(g: Graph, x: np.ndarray) -> dict[str, np.ndarray]:
    """The graph in numpy: QuantLinear by dequantize (no minimum), BlockSum, Linear, Add."""
    env = {"x": x, **{name: w.materialize() for name, w in g.weights.items()}}
    for n in g.nodes:
        ins = [env[i] for i in n.inputs if i]
        if n.op == "QuantLinear":
            prefix = n.inputs[1].rsplit(".", 1)[0]
            parts = [env.get(f"{prefix}.{p}") for p in ("q", "scales", "zero_points")]
            w = dequantize(QuantizedArrays(*parts), n.attrs["bits"], n.attrs["block_size"], K)
            out = ins[0] @ w.T
        elif n.op == "BlockSum":
            out = ins[0].reshape(*ins[0].shape[:-1], -1, n.attrs["block"]).sum(-1)
        elif n.op == "Linear":
            out = ins[0] @ ins[1].T
        elif n.op == "Add":
            out = ins[0] + ins[1]
        else:
            raise NotImplementedError(n.op)
        env[n.outputs[0]] = out
    return {o.name: env[o.name] for o in g.outputs}


@pytest.mark.parametrize("types", [
    {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"},  # a Q4_K_M layer: q and k share x's block sums, v has no minimum
    {"q": "Q4_1", "k": "Q4_1", "v": "Q4_1"},
    {"q": "Q4_1", "k": "Q4_0", "v": "Q5_K"},
])
def test_linears_on_one_input_share_one_block_sum(types):
    before, sources = graph(types)
    after = AddBlockMinimums().run(before)
    verify(after)
    with_minimums = [name for name in ("q", "k", "v") if BLOCK_TYPES[types[name]].minimum]
    ops = [n.op for n in after.nodes]
    assert ops.count("BlockSum") == 1 and ops.count("Linear") == len(with_minimums)
    assert ops.count("Add") == 1 + len(with_minimums)
    block_sum = next(n for n in after.nodes if n.op == "BlockSum")
    assert ops.index("BlockSum") == ops.index("QuantLinear") + 1  # right after the first linear on x
    assert all(n.inputs[0] == block_sum.outputs[0] for n in after.nodes if n.op == "Linear")
    assert [n.op for n in before.nodes] == ["QuantLinear"] * 3 + ["Add"]  # the input graph is untouched

    x = np.random.default_rng(9).standard_normal((2, 3, K)).astype(np.float32)
    got = evaluate(after, x)
    for name, out in zip(("q", "k", "v"), [o.name for o in before.outputs[1:]]):
        expected = x @ sources[name].materialize().T  # the file's value, minimum included
        np.testing.assert_allclose(got[out], expected, rtol=1e-4, atol=1e-4, err_msg=name)


def test_inputs_that_differ_get_their_own_block_sums():
    g = Graph("m")
    x = g.add_input("x", ("batch", "seq", K), F32)
    y = quant_linear(g, x, "layers.0.a", gguf_weight("Q4_1", K, 0))
    z = quant_linear(g, y, "layers.0.b", gguf_weight("Q4_1", 64, 1))
    g.add_output(z)
    after = AddBlockMinimums().run(g)
    verify(after)
    assert [n.op for n in after.nodes] == ["QuantLinear", "BlockSum", "Linear", "Add"] * 2
