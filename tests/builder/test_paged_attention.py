"""PagedAttention engines (recipe `target.attention: paged`, CUDA only): refused where they cannot run, the
paged layout in the manifest, and the lowered graph on CPU (ONNX shape inference and checker; ONNX Runtime's
CPU provider has no PagedAttention kernel). Tokens on a GPU: tests/runtime/test_paged_gpu.py."""
from __future__ import annotations

import json
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

from builder.recipe import RecipeError, load_recipe
from runtime.manifest.types import EngineError

PAGED = ["target.device=cuda", "target.dtype=float16", "target.attention=paged", "limits.max_batch_size=3",
         "limits.max_seq_len=96", "kv_cache.block_size=16"]


@pytest.mark.parametrize("target, message", [
    (["target.attention=paged"], "paged .* runs only on CUDA in float16 or bfloat16, not cpu float32"),
    (["target.attention=paged", "target.dtype=float16"], "not cpu float16"),
    (["target.attention=flash"], r"target.attention: 'flash' is not allowed; allowed: \['gqa', 'paged'\]"),
    (PAGED + ["parallel.tensor_parallel=2"], "paged is not supported with parallel.tensor_parallel > 1"),
])
def test_paged_is_refused_off_cuda(target, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(base={"model": "m"}, overrides=target)


@pytest.fixture(scope="module")
def paged_engine(tiny_checkpoint, tmp_path_factory) -> Path:
    from builder.build import build_engine

    recipe = load_recipe(base={"model": str(tiny_checkpoint)}, overrides=PAGED)
    return build_engine(recipe, tmp_path_factory.mktemp("paged") / "engine", log=lambda _: None)


def test_manifest_records_the_block_pool(paged_engine):
    manifest = json.loads((paged_engine / "manifest.json").read_text())
    kv = manifest["kv_cache"]
    assert manifest["target"]["attention"] == "paged" and "PagedAttention" in manifest["target"]["contrib_ops"]
    assert kv["block_size"] == 16 and kv["num_blocks"] == 3 * 96 // 16
    assert kv["bytes"] == kv["num_blocks"] * 16 * kv["bytes_per_token"]
    assert manifest["io"]["inputs"]["past_key_0"]["shape"] == ["num_blocks", 16, kv["kv_heads"], kv["head_dim"]]
    for name in ("cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping", "attention_metadata"):
        assert manifest["io"]["inputs"][name]["dtype"] == "int32"
    assert "seqlens_k" not in manifest["io"]["inputs"]
    # every input but the pools is what runtime/model/paged_runner.py feeds: ids, rotary tables, paged_inputs
    from runtime.model.paged_inputs import paged_inputs

    step = set(paged_inputs([[0]], [0], [1], block_size=16).feeds())
    pools = {f"past_{kind}_{layer}" for layer in range(kv["num_layers"]) for kind in ("key", "value")}
    fed = {"input_ids", "logits_index", "top_k", "cos_cache", "sin_cache"}
    assert set(manifest["io"]["inputs"]) - pools == fed | step
    assert "verification" not in manifest  # PagedAttention cannot run here: the build says it skipped the check


def test_graph_passes_shape_inference_and_the_checker(paged_engine):
    model = onnx.load(str(paged_engine / "model.onnx"))  # tiny: its weights inline, for the checker
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    kv = json.loads((paged_engine / "manifest.json").read_text())["kv_cache"]
    assert len(nodes) == kv["num_layers"] and not any(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    first = nodes[0]
    assert list(first.input[3:11]) == ["past_key_0", "past_value_0", "cumulative_sequence_length", "past_seqlens",
                                       "block_table", "cos_cache", "sin_cache", "slot_mapping"]
    assert first.input[16] == "attention_metadata" and list(first.output[1:]) == ["present_key_0", "present_value_0"]
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    # ONNX Runtime's SimplifiedLayerNormalization sits in the default domain, unknown to onnx: every engine
    # (GQA too) has it, so the checker runs on a copy where it is a standard op of the same signature
    for node in model.graph.node:
        if node.op_type == "SimplifiedLayerNormalization":
            node.op_type = "RMSNormalization"
            del node.attribute[:]
    model.opset_import[0].version = 23
    onnx.checker.check_model(model)


def test_cpu_refuses_paged_engines_by_name(paged_engine):
    from runtime.engine import LLM

    with pytest.raises(EngineError, match="target.attention paged"):
        LLM(paged_engine, device="cpu")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(Exception, match="PagedAttention"):  # what ONNX Runtime's CPU provider says
            ort.InferenceSession(str(paged_engine / "model.onnx"), providers=["CPUExecutionProvider"])


def test_int8_paged_engine_feeds_the_scales(tiny_checkpoint, tmp_path):
    """An int8 KV pool: PagedAttention reads the calibrated per-channel scales (inputs 14, 15) and stores int8."""
    from builder.build import build_engine

    recipe = load_recipe(base={"model": str(tiny_checkpoint)}, overrides=PAGED + ["kv_cache.dtype=int8"])
    engine = build_engine(recipe, tmp_path / "engine", log=lambda _: None)
    model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "PagedAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.input[14].endswith("k_scale") and node.input[15].endswith("v_scale")
    assert attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL"
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["io"]["inputs"]["past_key_0"]["dtype"] == "int8" and manifest["kv_cache"]["storage"] == "int8"
