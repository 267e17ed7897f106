"""Build recipes: defaults, nested sections, unknown and mistyped keys, --set overrides, refusals."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from builder.build import refuse_unsupported
from builder.recipe import (Limits, Passes, Quantization, Recipe, RecipeError, Target, Verify, from_dict,
                            load_recipe)

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "build_recipes").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_defaults():
    recipe = from_dict(Recipe, {"model": "ckpt"}, "recipe")
    assert recipe.model == "ckpt" and recipe.out is None
    assert recipe.target == Target("onnxruntime", "cpu", "float32")
    assert recipe.limits == Limits(max_batch_size=8, max_seq_len=2048, kv_memory_budget_mb=None)
    assert recipe.passes == Passes(True, True, True)
    assert recipe.quantization.mode == "none" and recipe.quantization.exclude == [] \
        and recipe.quantization.lm_head == "auto"  # the lm_head at 8 bits under 4-bit schemes, else with the build
    assert recipe.parallel.tensor_parallel == 1
    assert recipe.verify.enabled == "auto" and recipe.verify.tolerance == 1e-3
    assert load_recipe(base={"model": "ckpt"}) == recipe


def test_default_lists_are_not_shared():
    a, b = Quantization(), Quantization()
    a.exclude.append("embed")
    assert b.exclude == []


def test_nested_sections_from_yaml(tmp_path):
    path = write(tmp_path, """
model: checkpoints/x
out: engines/x
target: {backend: onnxruntime, device: cuda, dtype: bfloat16}
limits:
  max_batch_size: 2
  max_seq_len: 256
  kv_memory_budget_mb: 64          # an int where a float is expected is widened
passes: {fuse_qkv: false}
quantization: {mode: int4_rtn, group_size: 32, exclude: [lm_head, embed], accuracy_level: 4}
verify: {enabled: on, tolerance: 0.01, seq_len: 8}
""")
    recipe = load_recipe(path)
    assert recipe.out == "engines/x"
    assert recipe.target == Target("onnxruntime", "cuda", "bfloat16")
    assert recipe.limits == Limits(2, 256, 64.0) and isinstance(recipe.limits.kv_memory_budget_mb, float)
    assert recipe.passes == Passes(fuse_qkv=False, fuse_gate_up=True, fuse_add_rmsnorm=True)
    assert recipe.quantization == Quantization("int4_rtn", 32, True, ["lm_head", "embed"], 4, None)
    assert recipe.verify.enabled == "on"  # YAML `on` is a bool; Verify maps it back to "on"
    assert recipe.verify.tolerance == 0.01 and recipe.verify.seq_len == 8
    assert recipe.to_dict()["limits"] == {"max_batch_size": 2, "max_seq_len": 256, "kv_memory_budget_mb": 64.0}


def test_verify_enabled_accepts_bools_and_words():
    assert Verify(enabled=False).enabled == "off" and Verify(enabled=True).enabled == "on"
    assert load_recipe(base={"model": "m"}, overrides=["verify.enabled=off"]).verify.enabled == "off"
    with pytest.raises(RecipeError, match=r"verify.enabled: 'sometimes' is not allowed; allowed: \['auto', 'on', "
                                          r"'off'\]"):
        load_recipe(base={"model": "m"}, overrides=["verify.enabled=sometimes"])


def _allowed(message: str) -> list[str]:
    found = re.search(r"allowed: (\[.*\])", message)
    assert found, message
    return yaml.safe_load(found.group(1))


def test_unknown_top_level_key_names_key_and_allowed():
    with pytest.raises(RecipeError) as info:
        from_dict(Recipe, {"model": "m", "limitz": {}}, "recipe")
    message = str(info.value)
    assert "unknown key 'limitz'" in message
    assert _allowed(message) == ["cuda_graphs", "gguf", "kv_cache", "limits", "lora", "model", "out", "parallel", "passes", "quantization",
                                 "sampling_head", "speculative", "target", "verify"]


@pytest.mark.parametrize("section, key, allowed", [
    ("limits", "max_seq", ["kv_memory_budget_mb", "max_batch_size", "max_seq_len"]),
    ("passes", "fuse_qkvv", ["fuse_add_rmsnorm", "fuse_gate_up", "fuse_qkv"]),
    ("target", "precision", ["attention", "backend", "device", "dtype", "weight_kernels"]),
])
def test_unknown_nested_key_names_key_section_and_allowed(tmp_path, section, key, allowed):
    path = write(tmp_path, f"model: m\n{section}: {{{key}: 1}}\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert message.startswith(f"recipe.{section}: unknown key '{key}'")
    assert _allowed(message) == allowed


@pytest.mark.parametrize("data, field, detail", [
    ({"limits": {"max_seq_len": "long"}}, "limits.max_seq_len", "expected int, got str 'long'"),
    ({"limits": {"max_batch_size": True}}, "limits.max_batch_size", "expected int, got bool"),
    ({"limits": {"kv_memory_budget_mb": "lots"}}, "limits.kv_memory_budget_mb", "expected float or NoneType"),
    ({"target": {"dtype": "float64"}}, "target.dtype", "'float64' is not allowed"),
    ({"target": {"device": "tpu"}}, "target.device", "'tpu' is not allowed"),
    ({"passes": {"fuse_qkv": "yes"}}, "passes.fuse_qkv", "expected bool, got str 'yes'"),
    ({"passes": {"fuse_gate_up": 1}}, "passes.fuse_gate_up", "expected bool, got int"),
    ({"quantization": {"mode": "int3"}}, "quantization.mode", "'int3' is not allowed"),
    ({"quantization": {"group_size": 100}}, "quantization.group_size", "100 is not allowed"),
    ({"quantization": {"exclude": "lm_head"}}, "quantization.exclude", "got str 'lm_head'"),
    ({"limits": {"max_seq_len": 1}}, "limits.max_seq_len", "must be >= 2, got 1"),
    ({"parallel": {"tensor_parallel": 0}}, "parallel.tensor_parallel", "must be >= 1, got 0"),
    ({"model": 7}, "recipe.model", "expected str, got int"),
    ({"limits": 5}, "recipe.limits", "expected a mapping of Limits fields"),
])
def test_mistyped_value_names_the_field(data, field, detail):
    with pytest.raises(RecipeError) as info:
        from_dict(Recipe, {"model": "m"} | data, "recipe")
    message = str(info.value)
    assert field in message and detail in message, message


def test_missing_model_and_non_mapping_file(tmp_path):
    with pytest.raises(RecipeError, match="missing required key 'model'"):
        load_recipe(write(tmp_path, "limits: {max_seq_len: 64}\n"))
    with pytest.raises(RecipeError, match="a recipe is a YAML mapping, got list"):
        load_recipe(write(tmp_path, "- model\n"))


def test_bfloat16_on_cpu_refused():
    with pytest.raises(RecipeError, match="target.dtype: bfloat16 needs device cuda"):
        load_recipe(base={"model": "m"}, overrides=["target.dtype=bfloat16"])
    assert load_recipe(base={"model": "m"}, overrides=["target.device=cuda", "target.dtype=bfloat16"]) \
        .target.dtype == "bfloat16"


def test_set_overrides(tmp_path):
    path = write(tmp_path, "model: m\nlimits: {max_batch_size: 3, max_seq_len: 64}\npasses: {fuse_qkv: true}\n")
    recipe = load_recipe(path, ["limits.max_seq_len=1024", "passes.fuse_qkv=false",
                                "quantization.exclude=[lm_head, embed]", "model=other", "out=engines/o",
                                "limits.kv_memory_budget_mb=12.5", " verify.seq_len = 4"])
    assert recipe.limits == Limits(max_batch_size=3, max_seq_len=1024, kv_memory_budget_mb=12.5)
    assert recipe.passes.fuse_qkv is False
    assert recipe.quantization.exclude == ["lm_head", "embed"]
    assert recipe.model == "other" and recipe.out == "engines/o" and recipe.verify.seq_len == 4


def test_set_override_creates_missing_section_and_later_wins():
    recipe = load_recipe(base={"model": "m"}, overrides=["limits.max_seq_len=100", "limits.max_seq_len=200",
                                                          "limits.kv_memory_budget_mb=null"])
    assert recipe.limits.max_seq_len == 200 and recipe.limits.kv_memory_budget_mb is None


def test_set_override_values_are_validated():
    with pytest.raises(RecipeError, match="recipe.limits.max_seq_len: expected int, got str 'long'"):
        load_recipe(base={"model": "m"}, overrides=["limits.max_seq_len=long"])
    with pytest.raises(RecipeError, match="recipe.limits: unknown key 'max_seq'"):
        load_recipe(base={"model": "m"}, overrides=["limits.max_seq=5"])


@pytest.mark.parametrize("item, message", [
    ("limits.max_seq_len", "expected key=value"),
    ("=512", "expected key=value"),
    ("model.path=x", "'model' is not a section"),
])
def test_bad_set_syntax(item, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(base={"model": "m"}, overrides=[item])
    assert message in str(info.value) and item in str(info.value)


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_parses(path):
    recipe = load_recipe(path)
    assert recipe.model and recipe.out
    assert yaml.safe_load(path.read_text()).keys() <= set(recipe.to_dict())


def test_shipped_recipes_exist():
    assert {p.name for p in RECIPES} >= {"tiny_cpu.yaml", "llama7b_int8_tp2.yaml"}


def test_tiny_cpu_recipe_is_buildable_as_is():
    recipe = load_recipe(ROOT / "build_recipes" / "tiny_cpu.yaml")
    refuse_unsupported(recipe)  # nothing to refuse
    assert recipe.limits.max_seq_len == 512 and recipe.target.device == "cpu"


def test_llama7b_int8_tp2_is_not_refused():
    recipe = load_recipe(ROOT / "build_recipes" / "llama7b_int8_tp2.yaml")
    assert recipe.quantization.mode == "int8" and recipe.parallel.tensor_parallel == 2
    refuse_unsupported(recipe)  # int8 quantization and tensor parallelism are both supported
    with pytest.raises(RecipeError, match="target.backend 'tensorrt' is not supported yet"):
        refuse_unsupported(load_recipe(base={"model": "m"}, overrides=["target.backend=tensorrt"]))


# -- regressions: bugs found by these tests and fixed ---------------------------------------------
def test_regression_set_with_unparsable_value_is_a_recipe_error():
    with pytest.raises(RecipeError, match="limits.max_seq_len"):
        load_recipe(base={"model": "m"}, overrides=["limits.max_seq_len=[1"])


def test_regression_malformed_yaml_file_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError):
        load_recipe(write(tmp_path, "model: m\nlimits: {max_seq_len: 5\n"))


def test_regression_overrides_do_not_mutate_base():
    base = {"model": "m", "limits": {"max_seq_len": 100}}
    load_recipe(base=base, overrides=["limits.max_seq_len=200"])
    assert base == {"model": "m", "limits": {"max_seq_len": 100}}


def test_regression_float_field_accepts_exponent_without_dot():
    assert load_recipe(base={"model": "m"}, overrides=["verify.tolerance=1e-4"]).verify.tolerance == 1e-4


def test_tensor_parallel_refuses_a_draft_and_verify_on_up_front():
    """What a sharded engine cannot hold is refused before any work, by name."""
    from builder.build import BuildError

    tp2 = ["parallel.tensor_parallel=2", "limits.max_seq_len=64"]
    with pytest.raises(BuildError, match="verify.enabled on is not supported with tensor_parallel > 1"):
        refuse_unsupported(load_recipe(base={"model": "m"}, overrides=tp2 + ["verify.enabled=on"]))
    with pytest.raises(BuildError, match="a draft engine inside a tensor_parallel > 1 engine is not supported"):
        refuse_unsupported(load_recipe(base={"model": "m"}, overrides=tp2 + ["speculative.draft_model=d"]))
