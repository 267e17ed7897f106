"""End to end against transformers: tiny random checkpoints of the Llama family are built into
engines; logits must match within LOGIT_TOL and greedy generation must be token-for-token identical
to transformers' generate over 32+ tokens for a batch with ragged prompt lengths."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from builder.build import build_engine
from builder.recipe import load_recipe
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from tools.checkpoints.make_checkpoint import make_checkpoint

pytestmark = pytest.mark.e2e
LOGIT_TOL = 1e-4  # float32 engine vs float32 transformers, random weights (logits ~ O(1))
NEW_TOKENS = 32
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

VARIANTS = {
    "llama-gqa": dict(),
    "llama-mha-theta": dict(num_kv_heads=4, rope_theta=500000.0),
    "llama-mqa-llama3-rope": dict(num_heads=8, num_kv_heads=1, hidden_size=128, rope_scaling=LLAMA3_ROPE),
    "llama-tied-bias": dict(tie_word_embeddings=True, attention_bias=True),
    "qwen2-bias": dict(family="qwen2", num_heads=6, num_kv_heads=2, hidden_size=96),
    "mistral-sharded-bf16": dict(family="mistral", dtype="bfloat16", shard_size="60KB"),
    "llama-head-dim": dict(head_dim=32, num_layers=3),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def built(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = make_checkpoint(root / "ckpt", **VARIANTS[request.param], initializer_range=0.1, seed=3)
    recipe = load_recipe(base={"model": str(checkpoint)},
                         overrides=["limits.max_seq_len=128", "limits.max_batch_size=4", "verify.enabled=off"])
    engine = build_engine(recipe, root / "engine", log=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    return LLM(engine), model


def ragged_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(4, vocab, n).tolist() for n in (11, 3, 17, 6)]


def test_logits_match_transformers(built):
    llm, model = built
    prompts = ragged_prompts(model.config.vocab_size)
    lens = np.array([len(p) for p in prompts])
    ids = np.zeros((len(prompts), lens.max()), dtype=np.int64)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = p
    index = np.concatenate([row * lens.max() + np.arange(n) for row, n in enumerate(lens)])
    ours = np.split(llm.runner.run(0, ids, lens - 1, int(lens.max()), index), np.cumsum(lens)[:-1])
    with torch.no_grad():
        for p, got in zip(prompts, ours):
            ref = model(torch.tensor([p])).logits[0].numpy()
            np.testing.assert_allclose(got, ref, atol=LOGIT_TOL, rtol=0)


def test_greedy_batch_matches_generate(built):
    llm, model = built
    prompts = ragged_prompts(model.config.vocab_size)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for p, result in zip(prompts, results):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        assert result.token_ids == ref[0, len(p):].tolist()
        assert result.finish_reason == "length"


def test_decode_after_prefill_matches_full_forward(built):
    """Chunked extension of one row on top of its cached past gives the full-sequence logits."""
    llm, model = built
    tokens = ragged_prompts(model.config.vocab_size)[2]
    llm.runner.prefill(0, [tokens[:9]])
    chunk = llm.runner.extend(0, 9, tokens[9:], all_logits=True)
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0, 9:].numpy()
    np.testing.assert_allclose(chunk, ref, atol=LOGIT_TOL, rtol=0)
