"""MatMulNBits accuracy_level per layer kind (builder/quant/levels.py): `quantization.accuracy_level` as
a mapping puts the chosen level on exactly the chosen MatMulNBits nodes, the manifest records it, an
unknown kind or level is refused by name, and the engine's logits stay within a stated tolerance of
transformers loaded from the same GGUF (a tiny SmolLM2-shaped file: Q4_1 linears, Q8_0 tied embedding)."""
from __future__ import annotations

import pytest

from builder.pass_manager import PassError
from builder.recipe import RecipeError, load_recipe
from tests.builder.gguf_files import write_llama
from tests.builder.test_gguf import _against_transformers, _build

pytest.importorskip("gguf")
SMOLLM2_TYPES = {**dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), "Q4_1"), "embed": "Q8_0"}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def smollm2_like(tmp_path):
    return write_llama(tmp_path / "m.gguf", SMOLLM2_TYPES, hidden=256, inter=512, heads=4, kv_heads=2)


def _levels_by_kind(engine) -> dict[str, set[int]]:
    """Layer kind (from the weight's name) -> the accuracy_level attributes of its MatMulNBits nodes."""
    import onnx

    model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    levels: dict[str, set[int]] = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            weight = node.input[1].rsplit(".", 1)[0]  # layers.0.down.q -> layers.0.down
            kind = weight.rsplit(".", 1)[1] if weight.startswith("layers.") else "lm_head"
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            levels.setdefault(kind, set()).add(attrs["accuracy_level"])
    return levels


def test_each_kind_gets_its_level_in_the_graph_and_the_manifest(smollm2_like, tmp_path):
    manifest = _build(smollm2_like, tmp_path / "engine", **{"quantization.accuracy_level": "{default: 4, lm_head: 1, down: 0}"})
    assert _levels_by_kind(tmp_path / "engine") == {"qkv": {4}, "o": {4}, "gate_up": {4}, "down": {0}, "lm_head": {1}}
    record = manifest["quantization"]
    assert record["accuracy_level"] == 4  # the highest: activations are quantized somewhere
    assert record["accuracy_levels"] == {"down": 0, "gate_up": 4, "lm_head": 1, "o": 4, "qkv": 4}


def test_fused_kind_names_cover_the_parts_left_apart(smollm2_like, tmp_path):
    """`qkv` and `gate_up` also mean separate q/k/v and gate/up (Gemma 3 and Qwen3 keep q/k/v apart), so one
    recipe serves every family; a part's own key still wins over its fused kind's."""
    levels = "{default: 4, qkv: 1, k: 0, gate_up: 2}"
    manifest = _build(smollm2_like, tmp_path / "engine", **{"passes.fuse_qkv": "false", "passes.fuse_gate_up": "false",
                                                             "quantization.accuracy_level": levels})
    expected = {"q": 1, "k": 0, "v": 1, "gate": 2, "up": 2, "o": 4, "down": 4, "lm_head": 4}
    assert _levels_by_kind(tmp_path / "engine") == {kind: {level} for kind, level in expected.items()}
    assert manifest["quantization"]["accuracy_levels"] == dict(sorted(expected.items()))


def test_float_activations_everywhere_by_kind_is_exact(smollm2_like, tmp_path):
    """Every kind named at level 1 (default 4 left for none): the same exactness as accuracy_level 0."""
    levels = "{default: 4, qkv: 1, o: 1, gate_up: 1, down: 1, lm_head: 1}"
    _build(smollm2_like, tmp_path / "engine", **{"quantization.accuracy_level": levels})
    error, agree = _against_transformers(tmp_path / "engine", smollm2_like)
    assert error < 3e-5 and agree == 1.0, (error, agree)


def test_int8_activations_in_the_head_only_stay_close(smollm2_like, tmp_path):
    """Float layers, int8 activations only in the 8-bit lm_head (what build_recipes/smollm2_cpu.yaml may
    choose): measured 1.5e-3 of the largest logit on this file; bound 1e-2, greedy identical."""
    _build(smollm2_like, tmp_path / "engine", **{"quantization.accuracy_level": "{default: 1, lm_head: 4}"})
    error, agree = _against_transformers(tmp_path / "engine", smollm2_like)
    assert error < 1e-2 and agree == 1.0, (error, agree)


def test_unknown_layer_kind_is_refused_with_the_model_kinds(smollm2_like, tmp_path):
    with pytest.raises(PassError, match=r"'down_proj' is not a layer kind .*allowed keys: default, down, gate_up, "
                                         r"lm_head, o, qkv"):
        _build(smollm2_like, tmp_path / "engine", **{"quantization.accuracy_level": "{down_proj: 1}"})
    assert not (tmp_path / "engine" / "manifest.json").exists()


@pytest.mark.parametrize("value,message", [("7", r"accuracy_level: 7 is not one of \[0, 1, 2, 3, 4\]"),
                                           ("{down: 5}", r"accuracy_level.down: 5 is not one of \[0, 1, 2, 3, 4\]"),
                                           ("{down: true}", r"accuracy_level.down: expected int, got bool")])
def test_bad_level_is_a_recipe_error(value, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(base={"model": "x"}, overrides=[f"quantization.accuracy_level={value}"])
