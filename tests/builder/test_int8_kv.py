"""int8 KV cache (recipe `kv_cache: {dtype: int8}`): the plan's bytes, the calibration envelope, the
CalibrateKVScales pass on a small IR, the lowered GroupQueryAttention, and the trained checkpoint built
with it against transformers (build-time verification, logits on held-out text, greedy tokens).

Measured on checkpoints/trained/target (onnxruntime 1.32, CPU): the build's check on 3 random-token
sequences gives max |logit error| 0.26 (of logits up to ~13) and greedy agreement 0.98; on two windows of
200 held-out tokens max |logit error| 0.61 (4.2% of the largest logit, 14.7), mean 0.010, top-1 agreement
0.9925, and a 24-token greedy continuation identical to transformers.
Held-out perplexity: docs/ACCURACY.md (`float32+kv_int8`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from builder.passes.calibrate_kv_scales import CalibrateKVScales
from builder.passes.plan_kv_cache import PlanKVCache
from builder.quant.calibration import pair_envelope
from builder.recipe import RecipeError, load_recipe
from runtime.manifest.kv_spec import KVCacheSpec
from graph_helpers import F32, HEAD_DIM, KV_HEADS, decoder

ROOT = Path(__file__).resolve().parents[2]
TRAINED = ROOT / "checkpoints" / "trained" / "target"
# int8 KV on 2 x 200 held-out tokens of the trained model: max |logit error| 0.61 of logits up to 14.7 (4.2%),
# mean 0.010, top-1 agreement 0.9925; the bound is 6% of the largest reference logit, the build check's
# quantized style (verify.quantized_tolerance is 10%)
HELD_OUT_LOGIT_TOLERANCE = 0.06


def test_int8_storage_halves_float16_bytes():
    spec = KVCacheSpec(4, 2, 32, "float32", slots=3, max_seq_len=128, storage="int8")
    half = KVCacheSpec(4, 2, 32, "float16", slots=3, max_seq_len=128)
    assert spec.bytes_per_token * 2 == half.bytes_per_token == 2 * 4 * 2 * 32 * 2
    assert spec.bytes * 4 == KVCacheSpec(4, 2, 32, "float32", slots=3, max_seq_len=128).bytes
    assert spec.numpy_dtype() == np.int8 and spec.to_dict()["bytes_per_token"] == spec.bytes_per_token
    assert KVCacheSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="storage 'int4'"):
        KVCacheSpec(4, 2, 32, "float32", 1, 8, storage="int4")


def test_recipe_kv_cache_section():
    recipe = load_recipe(base={"model": "m"}, overrides=["kv_cache.dtype=int8"])
    assert recipe.kv_cache.dtype == "int8"
    with pytest.raises(RecipeError, match=r"kv_cache.dtype: 'fp8' is not allowed; allowed: \['float', 'int8'\]"):
        load_recipe(base={"model": "m"}, overrides=["kv_cache.dtype=fp8"])
    with pytest.raises(RecipeError, match="kv_cache.dtype int8 is not supported with parallel.tensor_parallel > 1"):
        load_recipe(base={"model": "m"}, overrides=["kv_cache.dtype=int8", "parallel.tensor_parallel=2"])


@pytest.mark.parametrize("interleaved", [False, True])
def test_pair_envelope_is_rotation_invariant(interleaved):
    """Rotating K by any position leaves the envelope unchanged, so a scale from it holds at every position."""
    rng = np.random.default_rng(0)
    dim, rotary = 16, 12  # partial rotary: the last 4 channels are not rotated
    k = rng.standard_normal((5, dim))
    first, second = (np.arange(0, rotary, 2), np.arange(1, rotary, 2)) if interleaved else \
        (np.arange(rotary // 2), np.arange(rotary // 2, rotary))
    for angle in rng.uniform(0, 100, 4):
        theta = angle * 10000.0 ** (-np.arange(rotary // 2) / (rotary // 2))
        rotated = k.copy()
        rotated[:, first] = k[:, first] * np.cos(theta) - k[:, second] * np.sin(theta)
        rotated[:, second] = k[:, second] * np.cos(theta) + k[:, first] * np.sin(theta)
        np.testing.assert_allclose(pair_envelope(rotated, rotary, interleaved), pair_envelope(k, rotary, interleaved))
        assert (np.abs(rotated) <= pair_envelope(k, rotary, interleaved) + 1e-12).all()


def test_calibrate_kv_scales_adds_per_channel_scales():
    g = PlanKVCache(2, 32, F32, storage="int8").run(decoder())
    extremes = [(np.full((KV_HEADS, HEAD_DIM), 12.7 * (layer + 1)), np.full((KV_HEADS, HEAD_DIM), 2.54))
                for layer in range(2)]
    after = CalibrateKVScales("unused", capture=lambda graph: extremes).run(g)
    for node in after.nodes_of("Attention"):
        layer = node.attrs["layer"]
        k_scale, v_scale = (after.weights[name].materialize() for name in node.inputs[4:6])
        assert k_scale.shape == (KV_HEADS, 1, HEAD_DIM) and k_scale.dtype == np.float32
        np.testing.assert_allclose(k_scale, 0.1 * (layer + 1), rtol=1e-6)
        np.testing.assert_allclose(v_scale, 0.02, rtol=1e-6)
    assert all(len(n.inputs) <= 4 for n in g.nodes_of("Attention"))  # the pass ran on a copy
    with pytest.raises(ValueError, match="storage int8"):
        CalibrateKVScales("unused", capture=lambda graph: extremes).run(PlanKVCache(2, 32, F32).run(decoder()))


@pytest.fixture(scope="module")
def int8_engine(tmp_path_factory) -> Path:
    if not (TRAINED / "model.safetensors").is_file():
        pytest.skip("no trained checkpoint (python -m tools.checkpoints.train_tiny_model)")
    from builder.build import build_engine

    recipe = load_recipe(base={"model": str(TRAINED)}, overrides=[
        "kv_cache.dtype=int8", "limits.max_batch_size=2", "limits.max_seq_len=256", "verify.enabled=on"])
    return build_engine(recipe, tmp_path_factory.mktemp("int8kv") / "engine", log=lambda _: None)


def test_int8_engine_graph_and_manifest(int8_engine):
    manifest = json.loads((int8_engine / "manifest.json").read_text())
    kv = manifest["kv_cache"]
    assert kv["storage"] == "int8" and kv["bytes_per_token"] == 2 * kv["num_layers"] * kv["kv_heads"] * kv["head_dim"]
    assert manifest["io"]["inputs"]["past_key_0"]["dtype"] == "int8"
    verification = manifest["verification"]
    assert verification["passed"] and verification["greedy_agreement"] >= 0.9, verification
    model = onnx.load(str(int8_engine / "model.onnx"), load_external_data=False)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == kv["num_layers"]
    for node in gqa:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["kv_cache_bit_width"] == 8 and attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL"
        assert len(node.input) == 14 and node.input[12].endswith("k_scale") and node.input[13].endswith("v_scale")


def test_int8_engine_matches_transformers_on_held_out_text(int8_engine):
    from builder.reference_check import compare, engine_logits, reference_logits
    from runtime.engine import LLM
    from runtime.request.params import SamplingParams
    from tokenizers import Tokenizer
    from tools.corpus import read_source, recorded_heldout_files

    text = read_source(recorded_heldout_files()[0])[:6000]
    ids = Tokenizer.from_file(str(TRAINED / "tokenizer.json")).encode(text).ids
    windows = [ids[:200], ids[200:400]]
    ours, theirs = engine_logits(int8_engine, windows), reference_logits(TRAINED, windows)
    error, agreement = compare(ours, theirs)
    largest = max(float(np.abs(t).max()) for t in theirs)
    assert error <= HELD_OUT_LOGIT_TOLERANCE * largest and agreement >= 0.97, (error, largest, agreement)

    llm = LLM(int8_engine)
    assert llm.runner.cache.keys[0].dtype == np.int8
    prompt = ids[:40]
    got = llm.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert _greedy_transformers(prompt, 24) == list(got.token_ids)


def _greedy_transformers(prompt: list[int], steps: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(TRAINED), dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(prompt):].tolist()
