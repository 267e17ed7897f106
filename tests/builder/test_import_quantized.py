"""Engines built straight from pre-quantized checkpoints (GPTQ v1 / v2, AutoAWQ GEMM, compressed-tensors
pack-quantized), written from each format's specification by tools/checkpoints/write_quantized.py (its
docstring says why no producer runs here) from the trained checkpoint's weights.

Reference: the test's own dequantization of what it wrote, saved as a float checkpoint and run by
transformers. The builder's repacking must be bit-exact (its MatMulNBits arrays dequantize to exactly
those weights), the engine at accuracy_level 0 (float activations) within 1e-3 of transformers'
logits with identical greedy tokens, and bad tensors or unsupported formats are refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from builder.quant.imported import open_checkpoint
from builder.quant.schemes import dequantize
from builder.weights import CheckpointError
from tools.checkpoints.write_quantized import write_float, write_quantized

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target"
pytestmark = pytest.mark.skipif(not (CHECKPOINT / "model.safetensors").is_file(),
                                reason=f"no trained checkpoint at {CHECKPOINT}")

CASES = [  # (format, bits, group, symmetric); group -1: per output channel. K is 192 (hidden) and 512.
    ("gptq", 4, 32, True), ("gptq", 4, 128, False), ("gptq", 8, 64, True), ("gptq_v2", 4, 64, False),
    ("awq", 4, 32, False), ("awq", 4, 64, True),
    ("compressed-tensors", 4, 32, True), ("compressed-tensors", 4, 128, False),
    ("compressed-tensors", 8, -1, True), ("compressed-tensors", 4, -1, False),
]


@pytest.mark.parametrize("fmt,bits,group,symmetric", CASES)
def test_repacking_is_bit_exact(fmt, bits, group, symmetric, tmp_path):
    expected = write_quantized(CHECKPOINT, tmp_path / "q", fmt, bits, group, symmetric)
    checkpoint = open_checkpoint(tmp_path / "q")
    for name, value in expected.items():
        source = checkpoint.source(name)
        arrays = source.load()
        assert (source.bits, arrays.zero_points is None) == (bits, symmetric)
        np.testing.assert_array_equal(dequantize(arrays, bits, source.block, value.shape[1]), value, err_msg=name)


def build(model: Path, out: Path, **settings) -> dict:
    from builder.build import build_engine
    from builder.recipe import load_recipe

    overrides = ["limits.max_seq_len=64", "limits.max_batch_size=1", "quantization.accuracy_level=0",
                 *(f"{k}={v}" for k, v in settings.items())]
    engine = build_engine(load_recipe(base={"model": str(model)}, overrides=overrides), out, log=lambda _: None)
    return json.loads((engine / "manifest.json").read_text())


@pytest.mark.parametrize("fmt,bits,group,symmetric", [CASES[1], CASES[2], CASES[4], CASES[7], CASES[9]])
def test_engine_matches_transformers_on_dequantized_weights(fmt, bits, group, symmetric, tmp_path):
    from builder.reference_check import compare, engine_logits, reference_logits

    expected = write_quantized(CHECKPOINT, tmp_path / "q", fmt, bits, group, symmetric)
    write_float(CHECKPOINT, tmp_path / "float", expected)
    manifest = build(tmp_path / "q", tmp_path / "engine")
    record = manifest["quantization"]
    assert record["source"]["format"] == fmt and record["source"]["bits"] == bits
    assert len(record["quantized"]) == 16 and list(record["skipped"]) == ["lm_head"]  # 4 layers: qkv, o, gate_up, down
    assert manifest["verification"]["passed"]  # the builder's own check on its dequantized reference
    sequences = [np.random.default_rng(i).integers(0, 4096, 40).tolist() for i in range(3)]
    ours, theirs = engine_logits(tmp_path / "engine", sequences), reference_logits(tmp_path / "float", sequences)
    error, agreement = compare(ours, theirs)
    assert error < 1e-3 * max(np.abs(t).max() for t in theirs), error
    assert agreement == 1.0


def test_truncated_or_misshapen_tensors_are_refused_by_name(tmp_path):
    from safetensors.numpy import load_file, save_file

    cases = {"gptq": "model.layers.1.mlp.down_proj.qzeros", "awq": "model.layers.1.mlp.down_proj.scales",
             "compressed-tensors": "model.layers.1.mlp.down_proj.weight_scale"}
    for fmt, name in cases.items():
        path = tmp_path / fmt
        write_quantized(CHECKPOINT, path, fmt, 4, 32, False)
        tensors = load_file(str(path / "model.safetensors"))
        tensors[name] = tensors[name][:-1].copy()  # one row short
        save_file(tensors, str(path / "model.safetensors"))
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            open_checkpoint(path).source(name.rsplit(".", 1)[0] + ".weight").load()
    path = tmp_path / "short_qweight"
    write_quantized(CHECKPOINT, path, "gptq", 4, 32, True)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.qweight"] = tensors["model.layers.0.mlp.up_proj.qweight"][:-2].copy()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"up_proj\.weight \(stored as model\.layers\.0\.mlp\.up_proj\.qweight"):
        build(path, tmp_path / "engine")


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"bits": 3}, "gptq quantization_config bits=3 is not supported"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format='marlin' is not supported"),
])
def test_unsupported_formats_are_refused(change, message, tmp_path):
    write_quantized(CHECKPOINT, tmp_path / "q", "gptq", 4, 32, True)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as error:
        open_checkpoint(tmp_path / "q")
    assert "supported: gptq" in str(error.value) or "supported:" in str(error.value)


def test_activation_quantized_compressed_tensors_is_refused(tmp_path):
    write_quantized(CHECKPOINT, tmp_path / "q", "compressed-tensors", 8, -1, True)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="input_activations.*not supported"):
        open_checkpoint(tmp_path / "q")


@pytest.mark.parametrize("act_order,permutes", [("shared", 4 * 4), ("each", 4 * 7)])
def test_desc_act_checkpoint_matches_transformers(act_order, permutes, tmp_path):
    """GPTQ desc_act: g_idx a permuted grouping. The engine sorts each weight's columns by group and
    gathers the activation in that order: one Gather per input and order (q/k/v and gate/up share one
    when their orders agree, and stay fused), one per linear otherwise."""
    import onnx

    from builder.reference_check import compare, engine_logits, reference_logits

    expected = write_quantized(CHECKPOINT, tmp_path / "q", "gptq", 4, 32, False, act_order=act_order)
    checkpoint = open_checkpoint(tmp_path / "q")
    for name, value in expected.items():
        assert not np.array_equal(checkpoint.read(f"{name[:-len('.weight')]}.g_idx"), np.arange(value.shape[1]) // 32)
        np.testing.assert_array_equal(checkpoint.source(name).materialize(), value, err_msg=name)
    write_float(CHECKPOINT, tmp_path / "float", expected)
    manifest = build(tmp_path / "q", tmp_path / "engine")
    assert manifest["verification"]["passed"]
    assert len(manifest["quantization"]["quantized"]) == (16 if act_order == "shared" else 28)
    graph = onnx.load(str(tmp_path / "engine" / "model.onnx"), load_external_data=False).graph
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.attribute[0].i == -1]
    assert len(gathers) == permutes
    sequences = [np.random.default_rng(i).integers(0, 4096, 40).tolist() for i in range(3)]
    ours, theirs = engine_logits(tmp_path / "engine", sequences), reference_logits(tmp_path / "float", sequences)
    error, agreement = compare(ours, theirs)
    assert error < 1e-3 * max(np.abs(t).max() for t in theirs), error
    assert agreement == 1.0


@pytest.mark.parametrize("change", ["swap", "out_of_range"])
def test_g_idx_that_is_not_a_grouping_is_refused(change, tmp_path):
    from safetensors.numpy import load_file, save_file

    write_quantized(CHECKPOINT, tmp_path / "q", "gptq", 4, 32, True, act_order="shared")
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.g_idx"
    g_idx = tensors[name]
    if change == "swap":  # a column moved to another group: one group of 33, one of 31
        g_idx[np.flatnonzero(g_idx == 0)[0]] = 1
    else:
        g_idx[3] = g_idx.max() + 1
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"o_proj\.g_idx.*not a grouping"):
        open_checkpoint(tmp_path / "q").source(name[:-len("g_idx")] + "weight")


def test_requantizing_an_imported_checkpoint_is_refused(tmp_path, monkeypatch):
    import builder.build

    write_quantized(CHECKPOINT, tmp_path / "q", "awq", 4, 32, False)
    monkeypatch.setattr(builder.build, "trace", lambda *a, **k: pytest.fail("traced before refusing"))
    with pytest.raises(Exception, match=r"^quantization.mode int4_rtn: .* is already quantized \(awq-quantized\).*"
                                        r"allowed: quantization.mode none"):
        build(tmp_path / "q", tmp_path / "engine", **{"quantization.mode": "int4_rtn"})


@pytest.mark.e2e
def test_two_ranks_keep_the_imported_integers(tmp_path):
    """Tensor parallelism over an imported checkpoint keeps its integers on each rank (rows, or whole groups of
    columns: o_proj's 96 columns per rank hold 3 groups of 32): 2 ranks match transformers on the dequantized
    weights as 1 rank does (within 1e-3 of the largest logit, greedy identical); a split inside a group of
    64 is refused by name."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.engine import LLM
    from tests.builder.test_families import batch_logits

    expected = write_quantized(CHECKPOINT, tmp_path / "q", "gptq", 4, 32, False)
    write_float(CHECKPOINT, tmp_path / "float", expected)
    manifest = build(tmp_path / "q", tmp_path / "engine", **{"parallel.tensor_parallel": 2,
                                                             "limits.max_batch_size": 2})
    assert len(manifest["quantization"]["quantized"]) == 16 and list(manifest["quantization"]["skipped"]) == ["lm_head"]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "float"), dtype=torch.float32).eval()
    prompts = [np.random.default_rng(i).integers(0, 4096, n).tolist() for i, n in enumerate((23, 9))]
    llm = LLM(tmp_path / "engine")
    try:
        for got, p in zip(batch_logits(llm, prompts), prompts):
            with torch.no_grad():
                want = model(torch.tensor([p])).logits[0].numpy()
            assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
            assert (got.argmax(-1) == want.argmax(-1)).all()
    finally:
        llm.close()
    write_quantized(CHECKPOINT, tmp_path / "q64", "gptq", 4, 64, True)
    with pytest.raises(Exception, match=r"o_proj.weight .*split its columns at \[0, 96\), inside its blocks of 64"):
        build(tmp_path / "q64", tmp_path / "engine64", **{"parallel.tensor_parallel": 2})
