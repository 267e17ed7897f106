"""GPTQ (int4_gptq / int8_gptq): the numpy solver against round-to-nearest on correlated inputs and,
where GPTQ has nothing to compensate (a diagonal Hessian), byte for byte; the layer-by-layer
calibration run holding one decoder layer at a time; and on the trained checkpoint, engines that
verify against transformers and beat round-to-nearest on held-out text (act-order on and off)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from builder.quant import dequantize, quantize
from builder.quant.gptq import Hessian, gptq_quantize
from builder.recipe import Quantization, RecipeError

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target"
trained = pytest.mark.skipif(not (CHECKPOINT / "model.safetensors").is_file(), reason=f"no trained checkpoint at {CHECKPOINT}")


def correlated_inputs(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Inputs with uneven channel magnitudes and correlated channels, as a linear layer sees them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)) * np.exp(rng.standard_normal(k))
    return (x @ (np.eye(k) + 0.3 * rng.standard_normal((k, k)) / np.sqrt(k))).astype(np.float32)


def output_mse(x: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float:
    return float(np.mean((x @ (w_hat - w).T) ** 2))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_its_inputs(bits, block, symmetric, act_order):
    """K = 200 ends in a partial block for every group size; GPTQ's output error on the calibration
    inputs is well under RTN's (measured: 0.2-0.4x)."""
    k = 200
    x = correlated_inputs(1024, k)
    w = (np.random.default_rng(1).standard_normal((48, k)) * 0.05).astype(np.float32)
    hessian = Hessian(k)
    hessian.add(x[:512])
    hessian.add(x[512:])  # accumulates over batches
    arrays = gptq_quantize(w, hessian.value(), bits, block, symmetric, act_order=act_order)
    rtn = quantize(w, bits, block, symmetric)
    assert arrays.q.shape == rtn.q.shape and arrays.scales.shape == rtn.scales.shape
    assert (arrays.zero_points is None) == symmetric
    if not symmetric:
        assert arrays.zero_points.shape == rtn.zero_points.shape
    gptq_error = output_mse(x, w, dequantize(arrays, bits, block, k))
    rtn_error = output_mse(x, w, dequantize(rtn, bits, block, k))
    assert gptq_error < 0.6 * rtn_error, (gptq_error, rtn_error)


@pytest.mark.parametrize("bits,block,symmetric", [(4, 32, True), (4, 128, False), (8, 64, True)])
def test_gptq_with_a_diagonal_hessian_is_round_to_nearest(bits, block, symmetric):
    """With uncorrelated inputs no column's error can be compensated elsewhere: the same bytes as the
    MLAS-exact quantizer, which pins GPTQ's scales, zero points, rounding and packing to the layout."""
    w = (np.random.default_rng(2).standard_normal((24, 100)) * 0.05).astype(np.float32)
    h = np.diag(np.random.default_rng(3).uniform(0.5, 2.0, 100)).astype(np.float32)
    ours, rtn = gptq_quantize(w, h, bits, block, symmetric), quantize(w, bits, block, symmetric)
    np.testing.assert_array_equal(ours.q, rtn.q)
    np.testing.assert_array_equal(ours.scales, rtn.scales)
    if not symmetric:
        np.testing.assert_array_equal(ours.zero_points, rtn.zero_points)


def test_dead_columns_are_quantized_as_zero():
    x = correlated_inputs(256, 64)
    x[:, 5] = 0
    hessian = Hessian(64)
    hessian.add(x)
    w = (np.random.default_rng(4).standard_normal((8, 64))).astype(np.float32)
    value = dequantize(gptq_quantize(w, hessian.value(), 4, 32), 4, 32, 64)
    assert np.all(value[:, 5] == 0) and np.all(np.isfinite(value))


def test_recipe_damp_and_modes():
    assert Quantization(mode="int4_gptq", damp=0.1, act_order=True).act_order
    Quantization(mode="int8_gptq")
    with pytest.raises(RecipeError, match="quantization.damp"):
        Quantization(mode="int4_gptq", damp=0)


@trained
def test_layerwise_run_holds_one_layer_at_a_time():
    """Only the layer being processed has real weights; the others stay on the meta device."""
    from builder.quant import calibration_sequences
    from builder.quant.layerwise import LayerwiseModel

    model = LayerwiseModel(CHECKPOINT)
    hidden = model.layer_inputs(calibration_sequences(CHECKPOINT, seq_len=64)[:4])
    seen: list[str] = []
    real_layers = []

    def update(prefix, layer):
        real_layers.append([i for i, lay in enumerate(model.layers)
                            if any(not p.is_meta for p in lay.parameters())])

    for index in range(len(model.layers)):
        hidden = model.run_layer(index, hidden, lambda name, x: seen.append(name), update)
    assert real_layers == [[i] for i in range(len(model.layers))]
    assert all(p.is_meta for p in model.layers.parameters())
    assert "model.layers.3.mlp.down_proj" in seen and "lm_head" not in seen


@trained
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_engine_verifies_against_transformers(act_order, tmp_path):
    """Built with verification on: transformers running the engine's dequantized GPTQ weights, and
    the float model's greedy picks."""
    import json

    from builder.build import build_engine
    from builder.recipe import load_recipe

    recipe = load_recipe(base={"model": str(CHECKPOINT)}, overrides=[
        "quantization.mode=int4_gptq", "quantization.group_size=32", f"quantization.act_order={act_order}",
        "limits.max_seq_len=128", "limits.max_batch_size=2"])
    manifest = json.loads((build_engine(recipe, tmp_path / "e", log=lambda _: None) / "manifest.json").read_text())
    assert manifest["verification"]["passed"]
    record = manifest["quantization"]
    assert record["mode"] == "int4_gptq" and record["gptq"]["act_order"] == act_order
    assert len(record["gptq"]["targets"]) == len(record["quantized"]) == 17  # 16 linears and the lm_head
    # GPTQ's own objective, the output error on the calibration inputs, is below RTN's for every linear
    assert all(t["error"] < t["error_rtn"] for t in record["gptq"]["targets"].values()), record["gptq"]


@trained
@pytest.mark.e2e
def test_gptq_perplexity_beats_round_to_nearest_on_heldout_text():
    """tools/accuracy.py on 4096 held-out tokens (text the model and the calibration never saw), group
    size 32, lm_head float: GPTQ's perplexity increase over float32 and its KL are below RTN's, act-order
    on and off. Measured on these tokens (ORT 1.32, accuracy_level 4): RTN +0.65%, KL 0.0132; GPTQ
    +0.47%, KL 0.0069; GPTQ act-order +0.41%, KL 0.0065. On all 20000 held-out tokens (docs/ACCURACY.md)
    the group-32 perplexities tie (+0.42%) while KL still halves; at group 128 GPTQ is +0.31% against +1.01%."""
    from tools.accuracy import evaluate

    results = evaluate(CHECKPOINT, ["int4_rtn", "int4_gptq", "int4_gptq+in_order"], group_size=32,
                       max_tokens=4096, window=256, log=lambda _: None)["results"]
    increase = {m: results[m]["perplexity"] / results["float32"]["perplexity"] - 1
                for m in ("int4_rtn", "int4_gptq", "int4_gptq+in_order")}
    assert increase["int4_gptq"] < increase["int4_rtn"], increase  # act-order, the default
    assert increase["int4_gptq+in_order"] < increase["int4_rtn"], increase
    for mode in ("int4_gptq", "int4_gptq+in_order"):
        assert results[mode]["kl_per_token"] < 0.7 * results["int4_rtn"]["kl_per_token"], results


@trained
def test_gptq_engine_has_the_round_to_nearest_graph(tmp_path):
    """The same ONNX graph as int4_rtn's, node for node with the same attributes and weight shapes: only
    the bytes of q, scales (and zero points) differ, so decode runs the same MatMulNBits kernels."""
    import onnx

    from builder.build import build_engine
    from builder.recipe import load_recipe

    graphs = {}
    for mode in ("int4_rtn", "int4_gptq"):
        recipe = load_recipe(base={"model": str(CHECKPOINT)}, overrides=[
            f"quantization.mode={mode}", "quantization.group_size=64", "quantization.symmetric=false",
            "limits.max_seq_len=64", "limits.max_batch_size=1", "verify.enabled=off"])
        model = onnx.load(str(build_engine(recipe, tmp_path / mode, log=lambda _: None) / "model.onnx"),
                          load_external_data=False)
        graphs[mode] = ([(n.op_type, list(n.input), [(a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute])
                         for n in model.graph.node],
                        {t.name: (t.data_type, list(t.dims)) for t in model.graph.initializer})
    assert graphs["int4_gptq"] == graphs["int4_rtn"]
    assert sum(op == "MatMulNBits" for op, _, _ in graphs["int4_gptq"][0]) == 17
