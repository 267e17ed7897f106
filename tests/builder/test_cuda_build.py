"""A CUDA engine built on a machine without CUDA is never left unverified: a float16 engine's graph is
run with ONNX Runtime's CPU execution provider against transformers; its 16-bit MatMulNBits scales are
checked in the ONNX file."""
from __future__ import annotations

import onnx
import onnxruntime
import pytest

from builder.build import build_engine
from builder.recipe import load_recipe
from runtime.manifest.load import load_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    "CUDAExecutionProvider" in onnxruntime.get_available_providers(), reason="checks the no-CUDA path")]


@pytest.mark.parametrize("quant", [[], ["quantization.mode=int4_rtn", "quantization.group_size=32"]])
def test_float16_cuda_engine_is_verified_on_the_cpu(tiny_checkpoint, tmp_path, quant):
    logs: list[str] = []
    recipe = load_recipe(base={"model": str(tiny_checkpoint)}, overrides=[
        "limits.max_seq_len=64", "limits.max_batch_size=2", "target.device=cuda", "target.dtype=float16"] + quant)
    manifest = load_manifest(build_engine(recipe, tmp_path / "engine", log=logs.append))
    report = manifest["verification"]
    assert report["passed"] and report["engine_device"] == "cpu" and report["reference_device"] == "cpu"
    assert report["max_abs_error"] <= report["tolerance"] and report["greedy_agreement"] >= 0.9
    assert any("CPU execution provider" in line for line in logs)
    assert manifest["target"]["device"] == "cuda" and manifest["cuda_graphs"]["enabled"]
    assert manifest["cuda_graphs"]["batch_sizes"] == [1, 2]
    if quant:
        model = onnx.load(str(tmp_path / "engine" / "model.onnx"), load_external_data=False)
        scales = [t for t in model.graph.initializer if t.name.endswith(".scales")]
        assert scales and {t.data_type for t in scales} == {onnx.TensorProto.FLOAT16}


def test_bfloat16_cuda_engine_is_verified_through_its_float32_twin(tiny_checkpoint, tmp_path):
    logs: list[str] = []
    recipe = load_recipe(base={"model": str(tiny_checkpoint)}, overrides=[
        "limits.max_seq_len=64", "target.device=cuda", "target.dtype=bfloat16"])
    manifest = load_manifest(build_engine(recipe, tmp_path / "engine", log=logs.append))
    report = manifest["verification"]
    assert report["passed"] and report["greedy_agreement"] == 1.0 and report["max_abs_error"] < 1e-3
    assert "float32 twin" in report["checked"] and "not bfloat16 arithmetic" in report["checked"]
    assert manifest["target"]["dtype"] == "bfloat16" and manifest["kv_cache"]["dtype"] == "bfloat16"


def test_quantized_bfloat16_cuda_engine_says_why_it_is_not_verified(tiny_checkpoint, tmp_path):
    logs: list[str] = []
    recipe = load_recipe(base={"model": str(tiny_checkpoint)}, overrides=[
        "limits.max_seq_len=64", "target.device=cuda", "target.dtype=bfloat16", "quantization.mode=int8"])
    manifest = load_manifest(build_engine(recipe, tmp_path / "engine", log=logs.append))
    assert "verification" not in manifest
    assert any("quantized cuda bfloat16 engine cannot be checked" in line for line in logs)
