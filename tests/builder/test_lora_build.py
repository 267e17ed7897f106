"""The builder's side of LoRA: the recipe section's refusals, the AddLoRA pass's inputs and manifest record, and
a quantized (int8) base with float adapters against transformers + PEFT."""
from __future__ import annotations

import numpy as np
import pytest

from builder.pass_manager import PassError
from builder.recipe import RecipeError, load_recipe
from lora_helpers import build_lora_engine, make_adapter, reference_logits


def recipe(checkpoint, **lora):
    return load_recipe(base={"model": str(checkpoint), "lora": {"max_adapters": 2, **lora}})


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor_parallel=2"], "lora is not supported with parallel.tensor_parallel > 1"),
    (["target.dtype=float16"], "lora needs target.dtype float32"),
    (["lora.rank=4"], "rank"),
    (["lora.max_rank=0"], "max_rank"),
    (["target.device=cuda", "cuda_graphs.enabled=true"], "lora is not supported with cuda_graphs.enabled"),
])
def test_recipe_refusals_name_the_field(tiny_checkpoint, overrides, message):
    with pytest.raises((RecipeError, ValueError), match=message):
        load_recipe(base={"model": str(tiny_checkpoint), "lora": {"max_adapters": 2}}, overrides=overrides)


@pytest.mark.parametrize("section, overrides", [({}, []), ({"max_rank": 8}, []), ({}, ["lora.max_rank=8"])])
def test_a_lora_section_without_max_adapters_is_refused(tiny_checkpoint, section, overrides):
    with pytest.raises(RecipeError, match=r"names no max_adapters.*give lora.max_adapters"):
        load_recipe(base={"model": str(tiny_checkpoint), "lora": section}, overrides=overrides)


def test_lora_on_cuda_builds_without_cuda_graphs(tiny_checkpoint):
    """The adapters' rows are picked per call (NonZero): no captured graph by default on cuda, 0 still allowed."""
    built = load_recipe(base={"model": str(tiny_checkpoint), "lora": {"max_adapters": 2}},
                        overrides=["target.device=cuda"])
    assert built.cuda_graphs.enabled is False
    assert load_recipe(base={"model": str(tiny_checkpoint), "lora": {"max_adapters": 0}},
                       overrides=["target.device=cuda"]).cuda_graphs.enabled is True


def test_no_lora_section_builds_no_lora_inputs(tiny_engine):
    import json
    manifest = json.loads((tiny_engine / "manifest.json").read_text())
    assert "lora" not in manifest and "lora_ids" not in manifest["io"]["inputs"]


def test_a_target_the_family_lacks_is_refused_naming_the_allowed(tiny_checkpoint, tmp_path):
    from builder.build import build_engine
    with pytest.raises(PassError, match=r"\['embed_tokens'\] are not linear layers of the llama family; allowed: "
                                        r"\['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        build_engine(recipe(tiny_checkpoint, targets=["embed_tokens"]), tmp_path / "e", log=lambda _: None)


def test_graph_inputs_and_manifest(tiny_checkpoint, tmp_path):
    import json
    engine = build_lora_engine(tiny_checkpoint, tmp_path / "e", max_rank=4, max_adapters=2, targets=["v_proj", "down_proj"])
    manifest = json.loads((engine / "manifest.json").read_text())
    inputs = manifest["io"]["inputs"]
    assert inputs["lora_ids"] == {"dtype": "int64", "shape": ["batch", "seq"]}
    # laid out for the GEMMs, each adapter's rank block side by side: v_proj sits in the fused qkv, so each
    # adapter's block spans 3 x max_rank (q and k columns stay zero); down_proj alone
    assert inputs["lora_a.layers.0.qkv"]["shape"] == [64, 2 * 12]
    assert inputs["lora_b.layers.0.qkv"]["shape"] == [2 * 12, 128]
    assert inputs["lora_a.layers.1.down"]["shape"] == [128, 2 * 4]
    assert not any(name.startswith("lora_a.layers.0.o") or "lm_head" in name for name in inputs)
    assert [lin["modules"] for lin in manifest["lora"]["linears"]] == [["q_proj", "k_proj", "v_proj"], ["down_proj"]] * 2


def test_int8_base_with_a_float_adapter(tiny_checkpoint, tmp_path):
    """The adapters' delta is float on top of an int8 base: the adapted logits move from the int8 base's by what
    PEFT's move from the float base's (within the int8 error)."""
    from builder.build import build_engine
    from runtime import LLM

    engine = build_engine(load_recipe(base={"model": str(tiny_checkpoint), "verify": {"enabled": "off"},
                                            "quantization": {"mode": "int8"},
                                            "lora": {"max_rank": 8, "max_adapters": 1}},
                                      overrides=["limits.max_seq_len=96", "limits.max_batch_size=2"]),
                          tmp_path / "int8", log=lambda _: None)
    adapter = make_adapter(tiny_checkpoint, tmp_path / "a", seed=4)
    ids = [1, 17, 33, 250, 7, 91]
    with LLM(engine, adapters={"a": adapter}) as llm:
        llm.runner.lora.assign(0, "a")
        got = llm.runner.extend(0, 0, ids, all_logits=True)
        llm.runner.lora.assign(0, None)
        base = llm.runner.extend(0, 0, ids, all_logits=True)
    want, want_base = reference_logits(tiny_checkpoint, adapter, ids), reference_logits(tiny_checkpoint, None, ids)
    int8_error = np.abs(base - want_base).max()
    assert np.abs((got - base) - (want - want_base)).max() < 4 * int8_error + 1e-3
    assert np.abs(got - want).max() < 4 * int8_error + 1e-3
