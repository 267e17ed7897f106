"""engine-compress --draft-for: a draft pruned from the trained target and distilled on the target's own greedy
continuations builds as the target's draft engine (a `speculative:` recipe, no other step), speculative decoding
with it gives exactly the target's greedy tokens, and it is accepted more often than the same pruned draft
undistilled."""
from __future__ import annotations

from pathlib import Path

import pytest

from builder.build import build_engine
from builder.compress.cli import TextSpec, compress
from builder.compress.distill import DistillConfig
from builder.compress.plan import CompressError, PrunePlan
from builder.recipe import load_recipe
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.speculation.speculator import Speculation
from tools.corpus import heldout_files, training_files

TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target"
PLAN = PrunePlan(layers=1, heads=3, ffn=192)
QUIET = dict(log=lambda _: None)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("drafts")
    text = tuple(str(p) for p in training_files()[200:204])
    spec = TextSpec(text, seq_len=32, calib_windows=16, heldout_windows=4, on_policy=16, prompt_len=8)
    plain = compress(TARGET, root / "pruned", PLAN, DistillConfig(steps=0), spec, draft_for=TARGET)
    cfg = DistillConfig(steps=24, batch_size=4, lr=3e-3, warmup=2, eval_every=24, save_every=100)
    distilled = compress(TARGET, root / "distilled", PLAN, cfg, spec, draft_for=TARGET)
    return plain, distilled


def _prompts(tokenizer, count: int = 4, length: int = 12) -> list[list[int]]:
    ids = tokenizer.encode(heldout_files()[0].read_text(encoding="utf-8")).ids  # never trained on
    return [ids[i * 97: i * 97 + length] for i in range(count)]


def _acceptance(llm: LLM, prompts, params) -> tuple[list[list[int]], float]:
    spec = Speculation("draft", num_draft=3, adaptive=False, fallback=False)  # no timing-dependent choices
    results = llm.generate(prompts, params, speculation=spec)
    stats = [r.metrics["speculation"] for r in results]
    return [r.token_ids for r in results], sum(s["accepted"] for s in stats) / sum(s["drafted"] for s in stats)


def test_distilled_draft_builds_with_its_target_and_is_accepted_more(tmp_path, drafts):
    plain_draft, distilled = drafts
    limits = ["limits.max_seq_len=96", "limits.max_batch_size=4", "verify.enabled=off"]
    recipe = load_recipe(base={"model": str(TARGET), "speculative": {"draft_model": str(distilled)}}, overrides=limits)
    engine = build_engine(recipe, tmp_path / "target", **QUIET)
    other = build_engine(load_recipe(base={"model": str(plain_draft)}, overrides=limits), tmp_path / "plain", **QUIET)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)

    llm = LLM(engine)  # the draft the recipe built into <engine>/draft
    prompts = _prompts(llm.tokenizer)
    alone = [r.token_ids for r in llm.generate(prompts, params)]
    tokens, accepted_distilled = _acceptance(llm, prompts, params)
    llm.close()
    assert tokens == alone

    llm = LLM(engine, draft=other)
    tokens, accepted_plain = _acceptance(llm, prompts, params)
    llm.close()
    assert tokens == alone
    assert accepted_distilled > accepted_plain + 0.05, (accepted_distilled, accepted_plain)


def test_chat_stream_is_the_targets_greedy_answers_to_the_prompts(tmp_path):
    """--chat-prompts: each conversation in the stream is the rendered prompt then exactly what transformers'
    greedy generate answers to it alone (batching with left padding changes nothing), cut at end-of-turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from builder.compress.draft import chat_stream, read_prompts

    tok = AutoTokenizer.from_pretrained(TARGET)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    (tmp_path / "p.txt").write_text("# a comment\ndef parse(text):\n\nclass Queue:\n  import os  \n")
    prompts = read_prompts(tmp_path / "p.txt")
    assert prompts == ["def parse(text):", "class Queue:", "import os"]
    stream = chat_stream(target, tok, prompts, new_tokens=12, batch_size=2).tolist()
    expected = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True).input_ids
        out = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)[0].tolist()
        answer = out[ids.shape[1]:]
        expected += ids[0].tolist() + (answer[: answer.index(tok.eos_token_id) + 1]
                                       if tok.eos_token_id in answer else answer)
    assert stream == expected
    assert tok.padding_side == AutoTokenizer.from_pretrained(TARGET).padding_side  # restored


def test_chat_prompts_need_a_target_and_a_prompt(tmp_path):
    text = TextSpec(tuple(str(p) for p in training_files()[200:201]), seq_len=32, chat_prompts=str(tmp_path / "p"))
    with pytest.raises(CompressError, match="--draft-for"):
        compress(TARGET, tmp_path / "out", PLAN, DistillConfig(steps=1), text)
    (tmp_path / "p").write_text("# only a comment\n\n")
    with pytest.raises(CompressError, match="no prompts"):
        compress(TARGET, tmp_path / "out", PLAN, DistillConfig(steps=1), text, draft_for=TARGET)
    assert not (tmp_path / "out").exists()
