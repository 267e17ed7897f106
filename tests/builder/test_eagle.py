"""EAGLE draft heads end to end on the trained 3M target: engine-compress --eagle trains a head, a recipe naming it
builds it beside the target (the target gaining its hidden_states output), the head's engine computes what the
trained torch head computes, and Speculation("eagle") gives exactly plain greedy decoding's tokens (and
transformers'); a head for another target, or speculation 'eagle' without a head, is refused by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from builder.build import BuildError, build_engine
from builder.compress.cli import TextSpec, compress_eagle
from builder.compress.distill import DistillConfig
from builder.compress.eagle import HEAD_FILE, WEIGHTS_FILE, EagleConfig, EagleHead, draft_vocabulary, evaluate_head
from builder.recipe import load_recipe
from runtime.engine import LLM
from runtime.manifest.load import EngineError
from runtime.request.params import SamplingParams
from runtime.request.validate import RequestError
from runtime.speculation.eagle import HEAD_MANIFEST
from runtime.speculation.speculator import Speculation
from tools.corpus import heldout_files, training_files

TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target"
QUIET = dict(log=lambda _: None)
LIMITS = ["limits.max_seq_len=128", "limits.max_batch_size=4", "verify.enabled=off"]
GREEDY = Speculation("eagle", num_draft=3, adaptive=False, fallback=False)  # no timing-dependent choices


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> Path:
    text = tuple(str(p) for p in training_files()[200:203])
    spec = TextSpec(text, seq_len=32, heldout_windows=4)
    cfg = DistillConfig(steps=30, batch_size=4, lr=3e-3, warmup=2, eval_every=15, save_every=100)
    return compress_eagle(TARGET, tmp_path_factory.mktemp("head") / "head", cfg, EagleConfig(), spec)


@pytest.fixture(scope="module")
def engine(head, tmp_path_factory) -> Path:
    recipe = load_recipe(base={"model": str(TARGET), "speculative": {"draft_model": str(head)}}, overrides=LIMITS)
    return build_engine(recipe, tmp_path_factory.mktemp("engine") / "target", **QUIET)


def _prompts(tokenizer, count: int = 4, length: int = 12) -> list[list[int]]:
    ids = tokenizer.encode(heldout_files()[0].read_text(encoding="utf-8")).ids  # never trained on
    return [ids[i * 97: i * 97 + length] for i in range(count)]


def test_draft_vocabulary_is_the_fewest_frequent_tokens_covering_the_share():
    rows = torch.tensor([[9, 1, 1, 1, 1, 2, 2, 3]])  # next tokens: 1 x4, 2 x2, 3 x1
    ids, covered = draft_vocabulary(rows, 200, 0.5, always=(7,))
    assert ids.tolist() == sorted(ids.tolist()) and len(ids) == 64  # a multiple of 64
    assert {1, 2, 3, 7} <= set(ids.tolist()) and covered == 1.0


@pytest.mark.e2e
def test_head_trains_and_records_its_target(head):
    record = json.loads((head / HEAD_FILE).read_text())
    assert record["kind"] == "eagle" and record["hidden_size"] == 192 and record["num_layers"] == 4
    first, last = record["history"][0], record["history"][-1]
    assert last["heldout_kl"] < first["heldout_kl"]  # it learned the target's next-token distribution
    assert last["accept_1"] > first["accept_1"]


@pytest.mark.e2e
def test_head_engine_computes_the_trained_head(head, engine):
    """The built head (fc folded into its embedding table, the family's layer, final norm, lm_head over the draft
    ids) against the torch head on the same tokens and features, and the target's hidden_states output against
    transformers' last hidden state."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    weights = load_file(str(head / WEIGHTS_FILE))
    module = EagleHead(target, weights.pop("draft_ids"))
    module.load_state_dict(weights)
    module.eval()
    llm = LLM(engine)
    ids = _prompts(llm.tokenizer, 1, 16)[0]
    with torch.no_grad():
        hidden = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [16, 192]
        f_ref, logits_ref = module(torch.tensor([ids[1:]]), hidden[None, :-1])
    _, engine_hidden = llm.runner.extend(0, 0, ids, all_logits=True, head="hidden")
    np.testing.assert_allclose(engine_hidden, hidden.numpy(), atol=1e-4)
    logits, f = llm.draft_runner.run(0, 0, ids[1:], hidden[:-1].numpy())
    llm.close()
    np.testing.assert_allclose(f, f_ref[0].numpy(), atol=1e-4)
    np.testing.assert_allclose(logits, logits_ref[0].numpy(), atol=1e-3)


@pytest.mark.e2e
def test_eagle_speculation_gives_plain_greedy_tokens_and_transformers(engine):
    from transformers import AutoModelForCausalLM

    llm = LLM(engine)
    prompts = _prompts(llm.tokenizer)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    alone = [r.token_ids for r in llm.generate(prompts, params)]
    results = llm.generate(prompts, params, speculation=GREEDY)
    batched = llm.generate(prompts, params, speculation=Speculation("eagle"))  # adaptive k, pay-or-fall-back
    sampled = llm.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.8, ignore_eos=True),
                           speculation=GREEDY)
    llm.close()
    assert [r.token_ids for r in results] == alone
    assert [r.token_ids for r in batched] == alone
    assert all(len(r.token_ids) == 16 for r in sampled)
    stats = [r.metrics["speculation"] for r in results]
    assert sum(s["drafted"] for s in stats) > 0 and sum(s["accepted"] for s in stats) > 0
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, alone):
        out = target.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out[0, len(prompt):].tolist() == tokens


def _torch_head(head: Path, target):
    from safetensors.torch import load_file

    weights = load_file(str(head / WEIGHTS_FILE))
    module = EagleHead(target, weights.pop("draft_ids"))
    module.load_state_dict(weights)
    return module.eval()


@pytest.mark.e2e
def test_engine_head_scored_teacher_forced_equals_evaluate_head(head, engine):
    """The runtime's own draft_chain on the engine (the target's hidden_states output, the head's engine and KV) at
    every position of a reply scores what evaluate_head scores on the same tokens with transformers' features: the
    engine drafts with the pairing and features the head was trained on."""
    from transformers import AutoModelForCausalLM

    from tools.compress.eagle_score import figures, score_engine

    llm = LLM(engine)
    sequences, reply = _prompts(llm.tokenizer, 4, 40), 8  # the "reply" (the drafted part) from position 8
    counts = [score_engine(llm, ids, reply) for ids in sequences]
    llm.close()
    ours = figures(sum(c[0] for c in counts), sum(c[1] for c in counts))
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    module = _torch_head(head, target)
    rows = torch.tensor(sequences)
    with torch.no_grad():
        features = target.model(input_ids=rows).last_hidden_state
        _, logits = module(rows[:, 1:], features[:, :-1])  # [4, 39, K]: at t, the draft of token t + 2
    for row, (_, _, chains) in enumerate(counts):  # each position's first draft is the torch head's (near-ties 1e-3)
        for last, drafts in enumerate(chains, start=reply):
            scores = logits[row, last - 1]
            assert scores[module.draft_ids.tolist().index(drafts[0])] >= scores.max() - 1e-3, (row, last)
    replies = torch.arange(rows.shape[1])[None].expand(len(sequences), -1) >= reply
    offline = evaluate_head(module, target.get_output_embeddings().weight.detach(), rows, features, replies=replies)
    assert ours["drafts_scored"] == offline["drafts_scored"] == 4 * (40 - reply)
    assert ours["accept_1"] > 0.05  # the head drafts something right
    assert abs(ours["accept_1"] - offline["accept_1"]) <= 0.01


@pytest.mark.e2e
def test_live_drafts_are_the_heads_chain_on_the_targets_features(head, engine, monkeypatch):
    """Every chain the runtime drafts while generating (4 requests in the in-flight batch: the first draft after the
    prompt, drafts after verifies that kept some, none or all, the head's KV beyond the accepted tokens stale) is the
    trained torch head's chain over transformers' features of the request's tokens (near-ties within 1e-3)."""
    from transformers import AutoModelForCausalLM

    import runtime.speculation.speculator as speculator

    chains = []

    def recorded(target, runner, seq, k, costs, timed):
        drafts, probs = speculator_draft_chain(target, runner, seq, k, costs, timed)
        chains.append((list(seq.all_ids), drafts))
        return drafts, probs

    speculator_draft_chain = speculator.draft_chain
    monkeypatch.setattr(speculator, "draft_chain", recorded)
    llm = LLM(engine)
    prompts = _prompts(llm.tokenizer)
    llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), speculation=GREEDY)
    llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True),
                 speculation=Speculation("eagle", num_draft=2, adaptive=True, fallback=False))
    llm.close()
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    module = _torch_head(head, target)
    assert len(chains) > 20
    for ids, drafts in chains:
        with torch.no_grad():
            hidden = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            x, f = list(ids[1:]), hidden[:-1]  # the pairs (f_t, x_{t+1}) before the newest token
            for token in drafts:
                predicted, logits = module(torch.tensor([x]), f[None])
                scores = logits[0, -1]
                assert scores[module.draft_ids.tolist().index(token)] >= scores.max() - 1e-3, (len(ids), drafts)
                x, f = x + [token], torch.cat([f, predicted[0, -1:]])


@pytest.mark.e2e
def test_a_head_for_another_target_is_refused_by_name(head, engine, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(head, other)
    record = json.loads((other / HEAD_FILE).read_text())
    (other / HEAD_FILE).write_text(json.dumps(record | {"hidden_size": 576}))
    recipe = load_recipe(base={"model": str(TARGET), "speculative": {"draft_model": str(other)}}, overrides=LIMITS)
    with pytest.raises(BuildError, match="trained for another target: its hidden_size is 576"):
        build_engine(recipe, tmp_path / "refused", **QUIET)
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    built = json.loads((copy / "draft" / HEAD_MANIFEST).read_text())
    (copy / "draft" / HEAD_MANIFEST).write_text(json.dumps(built | {"tokenizer_sha256": "0" * 64}))
    with pytest.raises(EngineError, match="trained for another target: its tokenizer_sha256"):
        LLM(copy)


@pytest.mark.e2e
def test_eagle_without_a_head_is_refused_by_name(engine):
    other = build_engine(load_recipe(base={"model": str(TARGET)}, overrides=LIMITS), engine.parent / "plain", **QUIET)
    llm = LLM(other)
    with pytest.raises(RequestError, match="speculation method 'eagle' needs an EAGLE draft head"):
        llm.generate(["def "], SamplingParams(max_new_tokens=4), speculation=GREEDY)
    llm.close()
