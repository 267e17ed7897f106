"""LoRA on a pipeline-parallel engine (CPU, gloo): a tiny random 4-layer Llama built with `lora:` and split in 2
stages serves adapter rows as pp1 does. Each stage's graph has only its layers' LoRA inputs; logits match
transformers + PEFT within the LoRA tests' 1e-4; a mixed in-flight batch (rows on different adapters, more
adapters than slots, rows on none) gives pp1's tokens; adapters loaded and unloaded at run time reach every
stage. LoRA with pipeline x tensor parallelism is refused by the recipe (tests/builder/test_pipeline_stages.py)."""
from __future__ import annotations

import numpy as np
import pytest

from lora_helpers import ALL, build_lora_engine, make_adapter, reference_greedy, reference_logits
from runtime import LLM, SamplingParams
from runtime.manifest.load import read_manifest
from runtime.parallel.stage_lora import stage_inputs
from tests.runtime.test_pipeline_parallel import checkpoint, prompts  # noqa: F401  (the pipeline tests' checkpoint)

PROMPT = [1, 17, 33, 250, 7, 91, 402, 5, 66]
LOGIT_TOL = 1e-4  # tests/runtime/test_lora.py's


@pytest.fixture(scope="module")
def engines(checkpoint, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("pp-lora")
    return {p: build_lora_engine(checkpoint, root / f"pp{p}", max_adapters=2, max_batch_size=6,
                                 overrides=(f"parallel.pipeline_parallel={p}",)) for p in (1, 2)}


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("pp-adapters")
    return {"all": make_adapter(checkpoint, root / "all", seed=1),
            "attn": make_adapter(checkpoint, root / "attn", r=8, alpha=16, targets=["q_proj", "v_proj"], seed=2),
            "rs": make_adapter(checkpoint, root / "rs", r=2, alpha=4, targets=["o_proj", "down_proj", "up_proj"],
                               use_rslora=True, seed=3)}


def test_each_stage_reads_only_its_layers_lora_inputs(engines):
    section = read_manifest(engines[2]).pipeline_parallel
    for rank, (first, last) in ((1, (0, 2)), (2, (2, 4))):
        names = stage_inputs(section, rank)
        layers = {int(n.split(".")[2]) for n in names}
        assert layers == set(range(first, last)), names
        assert len(names) == 2 * 4 * 2  # A and B of qkv, o, gate_up, down, for 2 layers
        (segment,) = section.stages[rank - 1].ranks[0].segments
        assert "lora_ids" in segment.inputs


@pytest.mark.parametrize("name", ["all", "rs"])
def test_logits_match_peft(engines, adapters, checkpoint, name):  # noqa: F811
    with LLM(engines[2], adapters={name: adapters[name]}) as llm:
        llm.runner.lora.assign(0, name)
        got = llm.runner.extend(0, 0, PROMPT, all_logits=True)
        llm.runner.lora.assign(0, None)
        base = llm.runner.extend(0, 0, PROMPT, all_logits=True)
    want = reference_logits(checkpoint, adapters[name], PROMPT)
    assert np.abs(want - reference_logits(checkpoint, None, PROMPT)).max() > 1e-2  # the adapter matters
    np.testing.assert_allclose(got, want, atol=LOGIT_TOL, rtol=0)
    np.testing.assert_allclose(base, reference_logits(checkpoint, None, PROMPT), atol=LOGIT_TOL, rtol=0)


def mixed_in_flight(engine, adapters, batch, names, new: int = 8) -> tuple[list[list[int]], dict]:
    """Half the requests, then the rest while those run; each on its adapter (None: the base)."""
    with LLM(engine, adapters=adapters) as llm:
        params = [SamplingParams(max_new_tokens=new, ignore_eos=True, adapter=n) for n in names]
        first = llm.executor.submit_sequences([llm.make_sequence(p, q) for p, q in zip(batch[:3], params[:3])])
        next(first[0].text_stream())  # the first tokens are out: the batch runs
        later = [llm.submit(p, q) for p, q in zip(batch[3:], params[3:])]
        return [h.result(timeout=120).token_ids for h in first + later], llm.executor.stats()


def test_mixed_in_flight_batch_identical_to_pp1(engines, adapters, checkpoint):  # noqa: F811
    """Three adapters on two slots and rows on none, over both micro-batches: each request gets pp1's tokens."""
    batch = prompts(512)
    names = ["all", None, "attn", "rs", "all", None]
    one, _ = mixed_in_flight(engines[1], adapters, batch, names)
    two, stats = mixed_in_flight(engines[2], adapters, batch, names)
    assert stats["virtual_engines"] == 2
    assert two == one
    assert len({tuple(t) for t in two[:4]}) == 4  # the adapters change the tokens
    assert list(two[3]) == reference_greedy(checkpoint, adapters["rs"], batch[3], 8)


def test_adapters_loaded_and_unloaded_at_run_time_reach_every_stage(engines, adapters, checkpoint):  # noqa: F811
    params = {n: SamplingParams(max_new_tokens=6, ignore_eos=True, adapter=n) for n in ("all", "attn")}
    with LLM(engines[2]) as llm:
        llm.load_adapter("all", adapters["all"])
        first = llm.generate([PROMPT], params["all"])[0].token_ids
        llm.unload_adapter("all")
        llm.load_adapter("attn", adapters["attn"])  # into the slot "all" had
        second = llm.generate([PROMPT], params["attn"])[0].token_ids
        base = llm.generate([PROMPT], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    assert list(first) == reference_greedy(checkpoint, adapters["all"], PROMPT, 6)
    assert list(second) == reference_greedy(checkpoint, adapters["attn"], PROMPT, 6)
    assert list(base) == reference_greedy(checkpoint, None, PROMPT, 6)


def test_a_step_carries_its_rows_adapter_slots_after_the_kv_copies():
    from runtime.parallel.stage_step import NEXT_TOKEN, StageStep
    from runtime.parallel.step import RELEASED

    copies = ((0, 4, 16), (RELEASED, 5, 0))
    step = StageStep(3, np.arange(6).reshape(2, 3), np.array([2, 1]), 3, np.array([2, 5]), copies, NEXT_TOKEN,
                     np.array([2, 0]), (1, 3))
    back = StageStep.from_tensor(step.to_tensor())
    assert back.copies == step.copies and back.adapters.tolist() == [2, 0] and back.new_slots == (1, 3)
    assert (back.start, back.ids.tolist(), back.index.tolist(), back.head) == (3, [[0, 1, 2], [3, 4, 5]], [2, 5],
                                                                               NEXT_TOKEN)
    plain = StageStep.from_tensor(StageStep(0, np.zeros((1, 1), np.int64), np.zeros(1), 1, np.zeros(1)).to_tensor())
    assert plain.adapters.size == 0 and plain.new_slots == ()
