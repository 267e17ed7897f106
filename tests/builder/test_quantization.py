"""Weight quantization: the numpy quantizer against ONNX Runtime's own (same bytes), MatMulNBits
against numpy dequantize-then-matmul, QuantizeWeights Before/After, AWQ scale folding and search.
Engines built end to end: tests/builder/test_quantized_engines.py."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

from builder.ir import Graph
from builder.passes.fold_rotary import FoldRotary
from builder.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from builder.passes.fuse_gate_up import FuseGateUp
from builder.passes.fuse_qkv import FuseQKV
from builder.passes.quantize_weights import QuantizeWeights
from builder.passes.search_awq_scales import SearchAWQScales, find_sites, fold
from builder.quant import (INT8_BLOCK, SCHEMES, ClippedWeight, HeadTie, QuantizedWeight, Quantizer, QuantScheme, ScaledWeight,
                           dequantize, fake_quantize, quantize, scheme_for, search_scales)
from builder.quant.calibration import Calibration, block_gram
from builder.recipe import Quantization
from builder.verifier import verify
from builder.weights import ArrayWeight
from graph_helpers import HEAD_DIM, HEADS, KV_HEADS, decoder, decoder_feeds, interpret

F32 = "float32"


def weight(n: int, k: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)


# -- numpy quantizer vs ONNX Runtime ---------------------------------------------------------------
def ort_quantize(w: np.ndarray, bits: int, block: int, symmetric: bool):
    n, k = w.shape
    blocks = -(-k // block)
    q = np.zeros((n, blocks, block * bits // 8), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    zp = np.zeros((n, -(-blocks * bits // 8)), np.uint8)
    oracle = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    oracle(q, np.ascontiguousarray(w.T), scales, zp, block, n, k, symmetric)
    return q, scales, zp


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block,k", [(16, 64), (32, 96), (64, 384), (128, 384), (256, 512),  # K / block whole
                                     (16, 8), (32, 100), (64, 200), (128, 688), (256, 688), (256, 1)])  # padded
def test_quantize_matches_onnxruntime_bytes(bits, symmetric, block, k):
    w = weight(40, k)
    w[1, :block] = 0.0  # an all-zero block
    w[2, :block] = np.abs(w[2, :block])  # a block of one sign
    w[3, -(k % block or block):] = -np.abs(w[3, -(k % block or block):])  # a last block of the other sign
    ours = quantize(w, bits, block, symmetric)
    q, scales, zp = ort_quantize(w, bits, block, symmetric)
    np.testing.assert_array_equal(ours.q, q)
    np.testing.assert_array_equal(ours.scales, scales)
    if symmetric:
        assert ours.zero_points is None
    else:
        np.testing.assert_array_equal(ours.zero_points, zp)


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
@pytest.mark.parametrize("k", [256, 240])  # 240: the last of 8 blocks holds 16 values and 16 of padding
def test_dequantize_error_is_within_a_step(bits, symmetric, k):
    w = weight(16, k)
    arrays = quantize(w, bits, 32, symmetric)
    assert arrays.q.shape == (16, 8, 32 * bits // 8) and arrays.scales.shape == (16, 8)
    assert dequantize(arrays, bits, 32).shape == (16, 256)
    padded = np.zeros((16, 256), np.float32)
    padded[:, :k] = dequantize(arrays, bits, 32, k) - w
    error = np.abs(padded).reshape(16, 8, 32)
    # rounding: half a step; symmetric maps the block's peak to -2^(bits-1), so a value of the other
    # sign and the same size clips at 2^(bits-1) - 1, one step short
    steps = 1.0 if symmetric else 0.5
    assert np.all(error <= np.abs(arrays.scales)[..., None] * steps * (1 + 1e-5))


def matmul_nbits(x: np.ndarray, arrays, n: int, k: int, bits: int, block: int, level: int) -> np.ndarray:
    inits = [helper.make_tensor("B", TensorProto.UINT8, arrays.q.shape, arrays.q.tobytes(), raw=True),
             helper.make_tensor("S", TensorProto.FLOAT, arrays.scales.shape, arrays.scales.tobytes(), raw=True)]
    if arrays.zero_points is not None:
        zp = arrays.zero_points
        inits.append(helper.make_tensor("Z", TensorProto.UINT8, zp.shape, zp.tobytes(), raw=True))
    node = helper.make_node("MatMulNBits", ["x"] + [t.name for t in inits], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=level)
    shape = ["d%d" % i for i in range(x.ndim - 1)]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape + [k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape + [n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("bits,symmetric,block", [(4, True, 32), (4, False, 64), (4, True, 128), (8, True, 256),
                                                  (8, False, 32)])
@pytest.mark.parametrize("x_shape", [(1, 256), (5, 256), (2, 3, 256), (5, 688), (2, 3, 100)])  # 688, 100: padded
def test_matmul_nbits_is_dequantize_then_matmul(bits, symmetric, block, x_shape):
    n, k = 48, x_shape[-1]
    arrays = quantize(weight(n, k, seed=1), bits, block, symmetric)
    x = np.random.default_rng(2).standard_normal(x_shape).astype(np.float32)
    expected = x @ dequantize(arrays, bits, block, k).T
    exact = matmul_nbits(x, arrays, n, k, bits, block, level=0)
    np.testing.assert_allclose(exact, expected, rtol=1e-4, atol=1e-5)
    # accuracy_level 4 quantizes x to int8 per block: ORT_NOTES measures ~1% relative error
    fast = matmul_nbits(x, arrays, n, k, bits, block, level=4)
    assert np.abs(fast - expected).max() <= 0.03 * np.abs(expected).max()


# -- schemes and lazy weights ----------------------------------------------------------------------
def test_schemes_registry_and_block_choice():
    assert set(SCHEMES) == {"int8", "int4_rtn", "int4_awq", "int4_gptq", "int8_gptq"} and SCHEMES["int4_awq"].awq
    assert SCHEMES["int4_gptq"].gptq and SCHEMES["int8_gptq"].bits == 8
    int8 = scheme_for(Quantization("int8"))
    assert (int8.bits, int8.group_size, int8.symmetric) == (8, INT8_BLOCK, True)  # the recipe's default block
    assert scheme_for(Quantization("int8", group_size=16)).group_size == 16  # the opt-in for accuracy
    int4 = scheme_for(Quantization("int4_rtn", group_size=32, symmetric=False))
    assert (int4.bits, int4.group_size, int4.symmetric) == (4, 32, False)
    with pytest.raises(ValueError, match="group_size 48 is not one of"):
        QuantScheme("odd", 4, 48)


def test_quantized_parts_quantize_once_and_forget(monkeypatch):
    monkeypatch.setattr("builder.quant.weights.ROWS_PER_CHUNK", 3)  # 8 rows: chunks of 3, 3, 2
    calls = []

    class Counting(ArrayWeight):
        def materialize(self):
            calls.append(1)
            return super().materialize()

    w = weight(8, 64)
    quantizer = Quantizer(Counting(w), 4, 32, symmetric=False)
    parts = {p: QuantizedWeight(quantizer, p) for p in ("q", "scales", "zero_points")}
    assert [parts[p].shape for p in parts] == [(8, 2, 16), (8, 2), (8, 1)] and calls == []
    assert parts["q"].dtype == "uint8" and parts["scales"].dtype == F32
    got = {p: parts[p].materialize() for p in ("q", "zero_points", "scales")}
    assert len(calls) == 1 and quantizer._result is None  # one quantization, then dropped
    expected = quantize(w, 4, 32, symmetric=False)
    for p in parts:
        np.testing.assert_array_equal(got[p], getattr(expected, p))
    padded = Quantizer(ArrayWeight(weight(8, 80), "w"), 4, 32, symmetric=False)  # 3 blocks, the last half full
    assert [QuantizedWeight(padded, p).shape for p in parts] == [(8, 3, 16), (8, 3), (8, 2)]
    assert [QuantizedWeight(padded, p).materialize().shape for p in parts] == [(8, 3, 16), (8, 3), (8, 2)]


# -- QuantizeWeights Before/After ------------------------------------------------------------------
def linear_graph(bias: bool = False) -> Graph:
    """embed -> RMSNorm -> a (64->96, bias?) -> b (96->100) -> c (100->64, K=100: a partial block) -> lm_head."""
    g = Graph("q")
    ids = g.add_input("input_ids", ("batch", "seq"), "int64")
    x = g.make("Embedding", [ids, g.add_weight("embed", ArrayWeight(weight(50, 64), "embed"))],
               ("batch", "seq", 64), F32)
    x = g.make("RMSNorm", [x, g.add_weight("norm", ArrayWeight(np.ones(64, np.float32), "norm"))],
               ("batch", "seq", 64), F32, eps=1e-5)
    for name, n, k in (("layers.0.a", 96, 64), ("layers.0.b", 100, 96), ("layers.0.c", 64, 100)):
        inputs = [x, g.add_weight(name, ArrayWeight(weight(n, k), name))]
        if bias and name == "layers.0.a":
            inputs.append(g.add_weight(name + "_bias", ArrayWeight(weight(1, n)[0], "bias")))
        x = g.make("Linear", inputs, ("batch", "seq", n), F32)
    g.make("Linear", [x, g.add_weight("lm_head", ArrayWeight(weight(50, 64), "lm_head"))],
           ("batch", "seq", 50), F32, out="logits")
    g.add_output("logits")
    return g


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_weights_before_after(symmetric):
    before = linear_graph(bias=True)
    after = QuantizeWeights(Quantization("int4_rtn", group_size=32, symmetric=symmetric, exclude=["lm_head"])).run(before)
    verify(after)
    assert [n.op for n in after.nodes] == ["Embedding", "RMSNorm", "QuantLinear", "QuantLinear", "QuantLinear",
                                           "Linear"]
    a, b, c = after.nodes[2:5]
    zp = ["layers.0.a.zero_points"] if not symmetric else [""]
    assert a.inputs == [after.nodes[1].outputs[0], "layers.0.a.q", "layers.0.a.scales"] + zp + ["layers.0.a_bias"]
    assert a.attrs == {"bits": 4, "block_size": 32, "K": 64, "N": 96, "accuracy_level": 4}
    assert len(b.inputs) == (3 if symmetric else 4) and b.attrs["K"] == 96
    assert c.attrs == {"bits": 4, "block_size": 32, "K": 100, "N": 64, "accuracy_level": 4}
    assert "layers.0.a" not in after.weights and "layers.0.a" not in after.values
    assert after.values["layers.0.a.q"].shape == (96, 2, 16) and after.values["layers.0.a.q"].dtype == "uint8"
    assert after.values["layers.0.c.q"].shape == (64, 4, 16)  # ceil(100 / 32) blocks, 28 values of padding
    record = after.meta.quantization.to_dict()
    assert record["mode"] == "int4_rtn" and sorted(record["quantized"]) == ["layers.0.a", "layers.0.b", "layers.0.c"]
    assert record["quantized"]["layers.0.c"] == {"N": 64, "K": 100, "block_size": 32, "last_block_padding": 28}
    assert record["quantized"]["layers.0.a"] == {"N": 96, "K": 64, "block_size": 32}
    assert record["skipped"] == {"lm_head": "excluded by pattern 'lm_head'"}
    assert "QuantLinear" not in {n.op for n in before.nodes}  # the input graph is untouched


def test_quantize_weights_exclusions_int8_and_accuracy_level():
    g = linear_graph()
    options = Quantization("int8", exclude=["layers.*.b"], accuracy_level=0)
    after = QuantizeWeights(options, device="cuda").run(g)
    record = after.meta.quantization.to_dict()
    assert sorted(record["quantized"]) == ["layers.0.a", "layers.0.c", "lm_head"]
    assert {t["block_size"] for t in record["quantized"].values()} == {INT8_BLOCK} and record["accuracy_level"] == 0
    assert record["skipped"] == {"layers.0.b": "excluded by pattern 'layers.*.b'"}
    assert QuantizeWeights(Quantization("int8"), device="cuda").accuracy_level == 0


def test_tied_embedding_stays_float():
    g = linear_graph()
    lm_head = g.nodes[-1]
    lm_head.inputs[1] = "embed"
    del g.weights["lm_head"], g.values["lm_head"]
    # asymmetric blocks: a layout GatherBlockQuantized cannot read by row (int8's blocks of 32 divide K 64)
    after = QuantizeWeights(Quantization("int8", exclude=[], symmetric=False)).run(g)
    assert after.meta.quantization.record["skipped"]["embed"].startswith("also read by Embedding")
    assert after.nodes[-1].op == "Linear" and "embed" in after.weights


# -- AWQ -------------------------------------------------------------------------------------------
FUSIONS = {"unfused": [FoldRotary], "fused": [FoldRotary, FuseQKV, FuseGateUp, FuseAddRMSNorm]}


def fused_decoder(variant: str, bias: bool) -> Graph:
    g = decoder(bias=bias)
    for make in FUSIONS[variant]:
        g = make().run(g)
    return g


@pytest.mark.parametrize("variant", sorted(FUSIONS))
@pytest.mark.parametrize("bias", [False, True])
def test_awq_folding_keeps_the_float_function(variant, bias):
    g = fused_decoder(variant, bias)
    sites, skipped = find_sites(g, lambda w: True)
    assert len(sites) == 8  # per layer: attention norm, attention output, MLP norm, gated activation
    assert list(skipped.values()) == ["produced by GatherTokens: no exact fold"]  # lm_head
    assert [s.tie is not None for s in sites] == [False, True, False, False] * 2
    folded, rng = g.copy(), np.random.default_rng(3)
    for site in sites:
        scale = np.exp(rng.uniform(-1.5, 1.5, g.values[site.input].shape[-1])).astype(np.float32)
        fold(folded, site, site.tie.tie(scale) if site.tie else scale)
    verify(folded)
    expected, actual = interpret(g, decoder_feeds()), interpret(folded, decoder_feeds())
    np.testing.assert_allclose(actual["logits"], expected["logits"], rtol=1e-4, atol=1e-5)
    assert not np.allclose(folded.weights[sites[0].linears[0]].materialize(), g.weights[sites[0].linears[0]].materialize())


def test_awq_fold_targets_of_the_fused_decoder():
    g = fused_decoder("fused", bias=True)
    sites, _ = find_sites(g, lambda w: True)
    v_rows, up_rows = (HEADS + KV_HEADS) * HEAD_DIM, g.values["layers.0.gate_up"].shape[0] // 2
    assert [(s.linears, s.targets) for s in sites[:4]] == [
        (["layers.0.qkv"], [("layers.0.attn_norm", 0)]),
        (["layers.0.o"], [("layers.0.qkv", v_rows), ("layers.0.qkv_bias", v_rows)]),
        (["layers.0.gate_up"], [("layers.0.mlp_norm", 0)]),
        (["layers.0.down"], [("layers.0.gate_up", up_rows), ("layers.0.gate_up_bias", up_rows)])]
    assert sites[1].tie == HeadTie(KV_HEADS, HEADS, HEAD_DIM)


@pytest.mark.parametrize("variant", ["unfused", "fused"])
def test_awq_never_clips_query_and_key_rows(variant):
    """Rows that make queries or keys keep their whole range (an error there passes through the softmax, which
    the output error the clip search minimizes does not see): a packed qkv's q and k rows, every row of an
    unfused q or k projection; v rows and the other linears are searched."""
    g = fused_decoder(variant, bias=False)
    after = SearchAWQScales("unused", Quantization("int4_awq", group_size=32), capture=outlier_capture).run(g)
    clips = {name: c for site in after.meta.awq["sites"] for name, c in site["clip"].items()}
    qk = (HEADS + KV_HEADS) * HEAD_DIM
    expected = {"layers.0.qkv": qk} if variant == "fused" else {"layers.0.q": HEADS * HEAD_DIM,
                                                                "layers.0.k": KV_HEADS * HEAD_DIM, "layers.0.v": 0}
    assert {n: clips[n]["unclipped_rows"] for n in expected} == expected
    assert clips["layers.0.o"]["unclipped_rows"] == 0 and clips["layers.0.down"]["unclipped_rows"] == 0
    for name, rows in expected.items():
        clipped = after.weights[name]
        np.testing.assert_array_equal(clipped.materialize()[:rows], clipped.source.materialize()[:rows])


@pytest.mark.parametrize("tie", [None, HeadTie(kv_heads=2, heads=4, head_dim=16)])
def test_awq_search_beats_round_to_nearest(tie):
    x = np.random.default_rng(4).standard_normal((256, 64)).astype(np.float32)
    x[:, [3, 19, 40]] *= 25.0  # outlier input channels, as LLM activations have
    result = search_scales(x, weight(96, 64), bits=4, block=32, tie=tie)
    assert result.mse <= 0.7 * result.mse_rtn and result.alpha > 0
    if tie is not None:  # one scale per v channel, shared by the query heads of a kv head
        heads = result.scale.reshape(2, 2, 16)
        np.testing.assert_array_equal(heads[:, 0], heads[:, 1])


def mlp_graph() -> Graph:
    """x -> RMSNorm -> gate/up (64 -> 128) -> silu * up -> down (128 -> 64)."""
    g = Graph("mlp")
    x = g.add_input("x", ("batch", "seq", 64), F32)
    h = g.make("RMSNorm", [x, g.add_weight("layers.0.mlp_norm", ArrayWeight(1 + weight(1, 64)[0], "norm"))],
               ("batch", "seq", 64), F32, eps=1e-5)
    lin = {name: g.make("Linear", [h, g.add_weight(f"layers.0.{name}", ArrayWeight(weight(128, 64, i), name))],
                        ("batch", "seq", 128), F32) for i, name in enumerate(("gate", "up"))}
    act = g.make("Activation", [lin["gate"]], ("batch", "seq", 128), F32, fn="silu")
    m = g.make("Mul", [act, lin["up"]], ("batch", "seq", 128), F32)
    w = g.add_weight("layers.0.down", ArrayWeight(weight(64, 128, 2), "down"))
    g.make("Linear", [m, w], ("batch", "seq", 64), F32, out="y")
    g.add_output("y")
    return g


def outlier_capture(graph: Graph, sites, blocks) -> dict[str, Calibration]:
    rng = np.random.default_rng(5)
    rows = {}
    for site in sites:
        x = rng.standard_normal((128, graph.values[site.input].shape[-1])).astype(np.float32)
        x[:, :4] *= 30.0
        rows[site.input] = Calibration(x, (block_gram(x, blocks[site.input]) / len(x)).astype(np.float32))
    return rows


@pytest.mark.parametrize("fuse", [False, True])
def test_search_awq_scales_pass_then_quantize(fuse):
    before = FuseGateUp().run(mlp_graph()) if fuse else mlp_graph()
    options = Quantization("int4_awq", group_size=32)
    after = SearchAWQScales("unused", options, capture=outlier_capture).run(before)
    verify(after)
    assert [n.op for n in after.nodes] == [n.op for n in before.nodes]  # no new op
    sites = after.meta.awq["sites"]
    assert len(sites) == 2 and all(s["mse_awq"] <= s["mse_rtn"] for s in sites)
    assert any(s["mse_awq"] < 0.9 * s["mse_rtn"] for s in sites)
    down = after.weights["layers.0.down"]
    assert isinstance(down, ClippedWeight) and isinstance(down.source, ScaledWeight)
    assert not any(isinstance(w, (ScaledWeight, ClippedWeight)) for w in before.weights.values())  # input untouched
    clips = [c for s in sites for c in s["clip"].values()]
    assert all(c["error"] <= c["error_rtn"] for c in clips) and any(c["error"] < c["error_rtn"] for c in clips)
    scaled_only = after.copy()  # the folded scales alone keep the float function; the clipping is quantization's
    scaled_only.weights = {k: w.source if isinstance(w, ClippedWeight) else w for k, w in after.weights.items()}
    x = {"x": np.random.default_rng(6).standard_normal((2, 3, 64)).astype(np.float32)}
    np.testing.assert_allclose(interpret(scaled_only, x)["y"], interpret(before, x)["y"], rtol=1e-4, atol=1e-5)
    quantized = QuantizeWeights(options).run(after)
    assert quantized.meta.quantization.record["awq"] == after.meta.awq
    q = quantized.weights["layers.0.down.q"]
    assert isinstance(q, QuantizedWeight) and isinstance(q.quantizer.source, ClippedWeight)


@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_clip_lowers_the_output_error_and_never_raises_it(symmetric):
    """search_clip against the true output error of the quantized layer on its calibration rows: the chosen
    bounds (each block's largest magnitude times r <= 1, a K the block does not divide included) never lose to
    plain rounding, and win where a few weights are outliers."""
    from builder.quant.awq import search_clip

    rng = np.random.default_rng(11)
    x = rng.standard_normal((256, 80)).astype(np.float32)
    w = (rng.standard_normal((48, 80)) * 0.05).astype(np.float32)
    w[rng.random(w.shape) < 0.02] *= 8
    gram = (block_gram(x, 32) / len(x)).astype(np.float32)
    result = search_clip(gram, w, 4, 32, symmetric)
    blocks = np.abs(np.pad(w, ((0, 0), (0, 16)))).reshape(48, 3, 32).max(-1)
    assert result.bound.shape == (48, 3) and np.all(result.bound <= blocks) and np.all(result.bound >= 0.5 * blocks - 1e-7)
    clipped = ClippedWeight(ArrayWeight(w, "w"), result.bound, 32).materialize()
    err = lambda v: float(np.mean((x @ (fake_quantize(v, 4, 32, symmetric) - w).T) ** 2))
    assert err(clipped) < 0.95 * err(w) and result.error < result.error_rtn
    none = search_clip(gram, w, 4, 32, symmetric, lowest=1.0)  # a grid of r = 1 only: plain rounding
    np.testing.assert_array_equal(none.bound, blocks)


def test_calibration_text_default_and_recipe_file(tiny_checkpoint, tmp_path):
    from builder.quant import CalibrationError, calibration_sequences

    default = calibration_sequences(tiny_checkpoint)
    assert len(default) * len(default[0]) >= 2000 and len({len(s) for s in default}) == 1  # they batch
    text = tmp_path / "calibration.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 30)
    assert {len(s) for s in calibration_sequences(tiny_checkpoint, text, seq_len=32)} == {32}
    with pytest.raises(CalibrationError, match="missing.txt is not a file"):
        calibration_sequences(tiny_checkpoint, tmp_path / "missing.txt")


def test_capture_keeps_a_row_sample_and_the_gram_of_every_row(tiny_checkpoint):
    """The AWQ capture: at most max_rows sampled rows (the scale search) and the block Gram over every
    calibration row (the clipping: a sample over-fits rare large inputs), the same as the Gram of all rows
    captured; scaled_gram gives the Gram of x / s without the rows."""
    from builder.passes.search_awq_scales import scaled_gram
    from builder.quant import calibration_sequences, capture_inputs

    sequences = calibration_sequences(tiny_checkpoint, seq_len=32)[:6]
    module = "model.layers.0.mlp.down_proj"
    sampled = capture_inputs(tiny_checkpoint, {module: 32}, sequences, max_rows=16)[module]
    every = capture_inputs(tiny_checkpoint, {module: 32}, sequences, max_rows=10**6)[module]
    assert len(sampled.rows) == 16 and len(every.rows) == 6 * 32
    np.testing.assert_allclose(sampled.gram, block_gram(every.rows, 32) / len(every.rows), rtol=1e-5, atol=1e-7)
    scale = np.exp(np.random.default_rng(2).uniform(-1, 1, every.rows.shape[1])).astype(np.float32)
    np.testing.assert_allclose(scaled_gram(every.gram, scale), block_gram(every.rows / scale, 32) / len(every.rows),
                               rtol=1e-4, atol=1e-7)


def test_self_written_calibration_is_the_models_own_text(tiny_checkpoint, monkeypatch):
    """quantization.calibration `self`: seeded sequences the float model writes, as many as the default text
    gives: a random ordinary first token, then GREEDY_START tokens that are the model's argmax, then samples."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from builder.quant import calibration
    from builder.quant.calibration import GREEDY_START, self_written_sequences

    written = self_written_sequences(tiny_checkpoint, count=3, seq_len=12)
    assert len(written) == 3 and {len(s) for s in written} == {12}
    assert written == self_written_sequences(tiny_checkpoint, count=3, seq_len=12)  # seeded
    special = {i for i, t in Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")).get_added_tokens_decoder().items()
               if t.special}
    assert not special & {s[0] for s in written}
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    with torch.no_grad():
        picks = model(torch.tensor(written)).logits.argmax(-1)  # [3, 12]: the argmax after each prefix
    assert (picks[:, :GREEDY_START] == torch.tensor(written)[:, 1:GREEDY_START + 1]).all()
    asked = []
    monkeypatch.setattr(calibration, "self_written_sequences", lambda model_dir, count, seq_len: asked.append(count) or [])
    calibration.calibration_sequences(tiny_checkpoint, "self", seq_len=64)
    assert asked == [len(calibration.calibration_sequences(tiny_checkpoint, seq_len=64))]
