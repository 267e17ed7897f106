"""Prompt buckets (LoadConfig.prompt_buckets, the CUDA default): multi-token calls run padded to a few lengths, warmed
at load, so a new prompt length never pays a call shape's first run. Padding must change nothing: the same logits
(float32, within 1e-5) and tokens, with chunked prompts on a past, speculation's verify calls and near-full rows."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.speculation.speculator import Speculation

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n\n\ndef main():\n    path = os.path.join(",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", "x"]


@pytest.fixture(scope="module")
def pair(trained_engine):
    plain, padded = LLM(trained_engine), LLM(trained_engine, prompt_buckets=True, max_tokens_per_step=24)
    yield plain, padded
    plain.close()
    padded.close()


def test_padded_lengths_stay_inside_the_row(pair):
    runner = pair[1].runner
    size = runner.spec.max_seq_len
    assert pair[0].runner.prompt_buckets == () and pair[0].runner.padded(0, 5) == 5  # CPU default: off
    assert [runner.padded(0, n) for n in (1, 2, 16, 17, 100)] == [1, 16, 16, 32, 128]
    assert runner.padded(size - 20, 17) == 17  # no bucket fits what is left of the row: the chunk as it is
    assert runner.padded(size - 40, 17) == 32


def test_padded_prefill_and_chunks_give_the_same_logits(pair):
    plain, padded = pair
    ids = [plain.tokenizer.encode(p).ids for p in PROMPTS]
    for prompt in ids:
        want = plain.runner.prefill(0, [prompt])
        np.testing.assert_allclose(padded.runner.prefill(0, [prompt]), want, atol=1e-5, rtol=0)
    # a chunk on a past, every position scored (a verify call's shape)
    first, rest = ids[1][:9], ids[1][9:]
    plain.runner.extend(1, 0, first), padded.runner.extend(1, 0, first)
    np.testing.assert_allclose(padded.runner.extend(1, len(first), rest, all_logits=True),
                               plain.runner.extend(1, len(first), rest, all_logits=True), atol=1e-5, rtol=0)
    np.testing.assert_allclose(padded.runner.prefill(0, ids[:3]), plain.runner.prefill(0, ids[:3]), atol=1e-5, rtol=0)


def test_padded_engine_generates_the_same_tokens(pair):
    plain, padded = pair
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=5)
    for params in (greedy, sampled):
        want = [r.token_ids for r in plain.generate(PROMPTS, params)]
        assert [r.token_ids for r in padded.generate(PROMPTS, params)] == want  # prompts chunked by 24 tokens
    want = [r.token_ids for r in plain.generate(PROMPTS, greedy)]
    assert [r.token_ids for r in padded.generate(PROMPTS, greedy, speculation=Speculation("ngram"))] == want


def test_buckets_are_warmed_at_load(pair):
    padded = pair[1]
    shapes = padded.runner.new_call_shapes
    assert shapes >= 2  # 16 and 32: the buckets up to the step's token budget, run at load on row 0
    padded.generate(["def f(x):"], SamplingParams(max_new_tokens=1))  # a greedy prompt on row 0: a warmed shape
    assert padded.runner.new_call_shapes == shapes
