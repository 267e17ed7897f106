"""EAGLE speculation composed with the rest of the runtime, on the float32 trained target with a tiny head trained
here (as tests/builder/test_eagle.py does): every request's tokens are plain greedy decoding's. The head drafts from
the features the prompt and plain calls returned (no target call of its own: checked against the target's hidden
states), and the target runs again only over a reused prefix. With int8 KV, prefix reuse, preemption (a KV budget of
two rows), a LoRA row (no head for its adapter: it decodes plainly while the others draft), a batch mixing EAGLE and
plain rows; structured outputs are refused by name."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from builder.build import build_engine
from builder.recipe import load_recipe
from lora_helpers import make_adapter
from test_eagle import GREEDY, LIMITS, QUIET, TARGET, head  # noqa: F401 (head: the tiny head fixture, trained here too)
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.request.structured import StructuredOutput
from runtime.request.validate import RequestError
from runtime.speculation.speculator import Speculation
from tools.corpus import heldout_files

PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)

pytestmark = pytest.mark.e2e


def _build(head: Path, out: Path, **sections) -> Path:
    recipe = load_recipe(base={"model": str(TARGET), "speculative": {"draft_model": str(head)}, **sections},
                         overrides=LIMITS)
    return build_engine(recipe, out, **QUIET)


@pytest.fixture(scope="module")
def engine(head, tmp_path_factory) -> Path:
    """The target with its head and LoRA inputs (one engine for every composition but int8 KV)."""
    lora = {"max_rank": 4, "max_adapters": 1, "targets": ["q_proj", "v_proj"]}
    return _build(head, tmp_path_factory.mktemp("engine") / "target", lora=lora)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return make_adapter(TARGET, tmp_path_factory.mktemp("adapter") / "a", targets=["q_proj", "v_proj"], seed=1)


def _prompts(llm: LLM, count: int = 4, length: int = 14) -> list[list[int]]:
    ids = llm.tokenizer.encode(heldout_files()[0].read_text(encoding="utf-8")).ids  # never trained on
    return [ids[i * 97: i * 97 + length] for i in range(count)]


def _plain(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    return [llm.generate([p], sp)[0].token_ids for p, sp in requests]


class _Recorder:
    """Wraps a runner method and records each call's arguments (and, for the head, its features)."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.calls = owner, name, []
        self.inner = getattr(owner, name)
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.inner(*args, **kwargs)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.inner)


def test_the_head_drafts_from_the_prompts_features_with_no_target_call_of_its_own(engine):
    """The prompt chunk returned every position's features: the head's first catch-up reads exactly the target's
    hidden states there (as a full call over the prompt computes them), and no target call re-runs the prompt."""
    with LLM(engine) as llm:
        prompt = _prompts(llm, 1)[0]
        _, reference = llm.runner.extend(0, 0, prompt, all_logits=True, features=True)  # [14, hidden]
        heads, targets = _Recorder(llm.draft_runner, "run"), _Recorder(llm.runner, "extend")
        result = llm.generate([prompt], PARAMS, speculation=GREEDY)[0]
        heads.restore(), targets.restore()
        plain = llm.generate([prompt], PARAMS)[0]
    assert result.token_ids == plain.token_ids and result.metrics["speculation"]["drafted"] > 0
    (slot, past, tokens, features), _ = heads.calls[0]
    assert past == 0 and tokens == prompt[1:] + result.token_ids[:1]  # the pairs (f_t, x_{t+1}) of the prompt
    np.testing.assert_allclose(features, reference, atol=1e-5)
    assert _reruns(targets) == []  # the prompt's features came with its chunk: no catch-up call on the target


def test_a_batch_mixing_eagle_plain_and_a_lora_row_gives_each_its_plain_tokens(engine, adapter):
    """Two rows speculate with the head, one decodes plainly, one runs on a LoRA adapter the head was not trained
    for: it falls back to plain decoding (and fetches no features) while the others keep drafting."""
    with LLM(engine, adapters={"a": adapter}) as llm:
        prompts = _prompts(llm)
        lora = SamplingParams(max_new_tokens=24, ignore_eos=True, adapter="a")
        requests = [(prompts[0], PARAMS, GREEDY), (prompts[1], PARAMS, None), (prompts[2], lora, GREEDY),
                    (prompts[3], PARAMS, GREEDY)]
        expected = _plain(llm, [(p, sp) for p, sp, _ in requests])
        base = _plain(llm, [(prompts[2], PARAMS)])[0]
        handles = [llm.submit(p, sp, spec) for p, sp, spec in requests]
        results = [h.result(timeout=300) for h in handles]
    assert [r.token_ids for r in results] == expected
    assert expected[2] != base  # the adapter changes the text (a real LoRA row)
    stats = [r.metrics.get("speculation") for r in results]
    assert stats[0]["drafted"] > 0 and stats[3]["drafted"] > 0 and stats[1] is None
    assert stats[2]["drafted"] == 0  # the LoRA row decoded plainly


def test_a_request_reusing_a_prefix_catches_up_the_target_over_the_reused_tokens_only(engine):
    """The second request's first 32 tokens are the first one's cached blocks (computed by no call of its own): the
    target runs again over those positions only (features, the last logits), the rest came with its chunk."""
    with LLM(engine, max_batch_size=1) as llm:
        text = llm.tokenizer.encode(heldout_files()[1].read_text(encoding="utf-8")).ids
        first, second = text[:40], text[:32] + text[200:210]
        expected = _plain(llm, [(first, PARAMS), (second, PARAMS)])
        llm.generate([first], PARAMS, speculation=GREEDY)
        before = llm.executor.stats()["prompt_tokens_reused"]
        targets = _Recorder(llm.runner, "extend")
        result = llm.generate([second], PARAMS, speculation=GREEDY)[0]
        targets.restore()
        reused = llm.executor.stats()["prompt_tokens_reused"] - before
    assert result.token_ids == expected[1] and reused == 32  # two blocks of 16
    assert _reruns(targets) == [(0, 32)]


def _reruns(targets: _Recorder) -> list[tuple[int, int]]:
    """The catch-up's target calls (features and the last logits, no head asked for: eagle._features_for), as
    (past_len, tokens); a prompt chunk asks for its head's output too, a verify for every position's logits."""
    return [(args[1], len(args[2])) for args, kw in targets.calls
            if kw.get("features") and "head" not in kw and not kw.get("all_logits")]


def test_preempted_rows_resume_and_keep_plain_greedy_tokens(engine):
    """A KV budget of two rows for four requests preempts some: they recompute their prompt and tokens (the
    recompute returns their features again) and draft on."""
    with LLM(engine, max_batch_size=1) as probe:
        row_mb = probe.spec.bytes_per_slot / 2**20
        prompts = _prompts(probe, 4, 20)
        params = SamplingParams(max_new_tokens=60, ignore_eos=True)
        expected = _plain(probe, [(p, params) for p in prompts])
    with LLM(engine, max_batch_size=4, kv_memory_mb=2 * row_mb, max_tokens_per_step=32) as llm:
        handles = [llm.submit(p, params, GREEDY) for p in prompts]
        results = [h.result(timeout=300) for h in handles]
        stats = llm.executor.stats()
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0  # the budget was really exceeded
    assert [r.token_ids for r in results] == expected
    assert sum(r.metrics["speculation"]["drafted"] for r in results) > 0


def test_structured_outputs_with_eagle_are_refused_by_name(engine):
    with LLM(engine) as llm:
        params = SamplingParams(max_new_tokens=8, structured=StructuredOutput.json({"type": "object"}))
        with pytest.raises(RequestError, match="structured outputs cannot be combined with speculation"):
            llm.generate(["{"], params, speculation=GREEDY)


def test_an_int8_kv_cache_keeps_plain_greedy_tokens(head, tmp_path):
    int8 = _build(head, tmp_path / "int8", kv_cache={"dtype": "int8"})
    with LLM(int8) as llm:
        prompts = _prompts(llm)
        expected = _plain(llm, [(p, PARAMS) for p in prompts])
        results = llm.generate(prompts, PARAMS, speculation=GREEDY)
        adaptive = llm.generate(prompts, PARAMS, speculation=Speculation("eagle"))
    assert [r.token_ids for r in results] == expected and [r.token_ids for r in adaptive] == expected
    assert sum(r.metrics["speculation"]["drafted"] for r in results) > 0
