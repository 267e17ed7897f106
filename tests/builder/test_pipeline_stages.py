"""Pipeline stages at build: the layer ranges planned (balanced by weight bytes, or given), bad splits refused
before any weight is read, and families beyond Llama split by layers and run as stage processes: every
position's logits within LOGIT_TOL of transformers and greedy tokens identical (Qwen3 with a tied embedding the
last stage reads as its lm_head, Gemma 3's local and global layers with their own rotary tables, a Qwen3 MoE
whose experts stay whole within their stage)."""
from __future__ import annotations

import pytest
import torch
from test_families import VARIANTS, VOCAB, assert_logits_match, make_family_checkpoint, ragged_prompts
from test_moe_families import VARIANTS as MOE_VARIANTS
from transformers import AutoModelForCausalLM

from builder.build import build_engine
from builder.engine_dir import BuildError
from builder.pipeline_stages import StageError, plan_stages
from builder.recipe import RecipeError, load_recipe
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from tests.runtime.parallel_helpers import hf_greedy
from tools.checkpoints.make_checkpoint import make_checkpoint

NEW_TOKENS = 10


def recipe(checkpoint, *overrides):
    return load_recipe(base={"model": str(checkpoint)},
                       overrides=["limits.max_seq_len=96", "limits.max_batch_size=4", "verify.enabled=off", *overrides])


@pytest.mark.parametrize("costs, stages, extra, ranges", [
    ([1] * 4, 2, 0, [(0, 2), (2, 4)]),
    ([1] * 4, 2, 2, [(0, 3), (3, 4)]),  # the lm_head weighs two layers: the last stage holds one layer
    ([5, 1, 1, 1, 1, 1], 2, 0, [(0, 1), (1, 6)]),
    ([1] * 5, 4, 0, [(0, 2), (2, 3), (3, 4), (4, 5)]),
    ([1] * 3, 3, 0, [(0, 1), (1, 2), (2, 3)]),
])
def test_balanced_ranges(costs, stages, extra, ranges):
    assert plan_stages(len(costs), stages, None, costs, extra) == ranges


def test_given_ranges():
    assert plan_stages(32, 2, [10, 22]) == [(0, 10), (10, 32)]


@pytest.mark.parametrize("layers, stages, given, message", [
    (2, 3, None, "pipeline_parallel 3 is more than the model's 2 layers"),
    (4, 2, [1, 2], r"pipeline_layers \[1, 2\] adds up to 3 layers; the model has 4"),
])
def test_bad_plans_refused(layers, stages, given, message):
    with pytest.raises(StageError, match=message):
        plan_stages(layers, stages, given)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pipeline_parallel=2", "parallel.pipeline_layers=[2]"], "gives 1 stages, pipeline_parallel is 2"),
    (["parallel.pipeline_parallel=2", "parallel.pipeline_layers=[2, 0]"], "leaves a stage empty"),
    (["parallel.pipeline_parallel=2", "parallel.tensor_parallel=2", "lora.max_adapters=2"],
     "lora is not supported with a pipeline_parallel 2 x tensor_parallel 2 engine yet"),
])
def test_recipe_refuses(tmp_path, overrides, message):
    with pytest.raises(RecipeError, match=message):
        recipe(tmp_path, *overrides)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pipeline_parallel=3"], "pipeline_parallel 3 is more than the model's 2 layers"),
    (["parallel.pipeline_parallel=2", "parallel.pipeline_layers=[1, 2]"], "adds up to 3 layers; the model has 2"),
])
def test_build_refuses_a_split_that_does_not_fit_before_any_work(tmp_path, overrides, message, monkeypatch):
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    import builder.build as build

    monkeypatch.setattr(build, "pipeline", lambda *a: pytest.fail("the pipeline ran before the split was checked"))
    with pytest.raises(BuildError, match=message):
        build_engine(recipe(checkpoint, *overrides), tmp_path / "engine", log=lambda _: None)
    assert not (tmp_path / "engine").exists()


FAMILIES = {
    "qwen3-tied-window": (VARIANTS["qwen3-tied-window"], 2),
    "gemma3-local-global": (VARIANTS["gemma3-local-global"], 3),
    "qwen3moe-normtopk-dense-layer": (MOE_VARIANTS["qwen3moe-normtopk-dense-layer"], 2),
}


def _matches_transformers(family: str, tmp_path, *parallel: str, processes: tuple[int, int, int] | None = None):
    """The family's engine built with `parallel`: every position's logits and the greedy tokens of a ragged batch
    as transformers' (and, given, the manifest's (stages, tensor_parallel, stage processes))."""
    config, _ = FAMILIES[family]
    checkpoint = make_family_checkpoint(tmp_path / "ckpt", config())
    engine = build_engine(recipe(checkpoint, *parallel), tmp_path / "engine", log=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    prompts = ragged_prompts(VOCAB)
    llm = LLM(engine)
    try:
        section = llm.manifest.pipeline_parallel
        if processes is not None:
            assert (section.size, section.tensor_parallel, len(llm.runner.workers)) == processes
        assert_logits_match(llm, model)
        results = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        llm.close()
    assert [r.token_ids for r in results] == hf_greedy(model, prompts, NEW_TOKENS)


@pytest.mark.e2e
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stages_match_transformers(family, tmp_path):
    stages = FAMILIES[family][1]
    _matches_transformers(family, tmp_path, f"parallel.pipeline_parallel={stages}", processes=(stages, 1, stages))


@pytest.mark.e2e
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pp2_tp2_matches_transformers(family, tmp_path):
    """Two stages of two tensor-parallel ranks each (Qwen3 tied, Gemma 3 local/global split 2 + 1, Qwen3 MoE with
    its experts sharded by intermediate channel and its dense layer)."""
    _matches_transformers(family, tmp_path, "parallel.pipeline_parallel=2", "parallel.tensor_parallel=2",
                          processes=(2, 2, 4))
