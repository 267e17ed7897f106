"""Log-probabilities (issue 39) on the trained float32 engine, against transformers on the same weights:
prompt tokens (echo) and generated ones equal log-softmax of transformers' logits within 1e-4, top-N sets
identical, through the Python API and engine-serve (streamed and not, completions and chat); scored rows
read full logits while the others keep the sampling head's fast path and give what they give alone."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from runtime.batching.decode import head_for
from runtime.engine import LLM, RequestError
from runtime.request.params import SamplingParams
from runtime.serve.app import RunningServer, create_app
from runtime.speculation.speculator import Speculation

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def main(args):\n    parser = "
TOL = 1e-4


@pytest.fixture(scope="module")
def llm(trained_engine):
    engine = LLM(trained_engine)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ROOT / "checkpoints" / "trained" / "target", dtype=torch.float32)
    model.eval()

    def logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().numpy()

    return logits


def log_softmax(x: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(x), -1).numpy()


def check(entry, row: np.ndarray, token: int, top: int) -> None:
    """One TokenLogprob against a reference log-softmax row."""
    assert entry.token == token and abs(entry.logprob - row[token]) < TOL, (entry.logprob, row[token])
    assert {t for t, _ in entry.top} == set(np.argsort(-row)[:top].tolist())
    for t, lp in entry.top:
        assert abs(lp - row[t]) < TOL


def test_python_api_equals_transformers(llm, reference):
    c = llm.generate([PROMPT], SamplingParams(max_new_tokens=12, logprobs=5, prompt_logprobs=3))[0]
    ids = llm.encode(PROMPT) + c.token_ids
    lp = log_softmax(reference(ids))
    n = c.prompt_tokens
    assert c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == n and len(c.logprobs) == len(c.token_ids) == 12
    for i in range(1, n):
        check(c.prompt_logprobs[i], lp[i - 1], ids[i], 3)
    for j, entry in enumerate(c.logprobs):
        check(entry, lp[n + j - 1], ids[n + j], 5)
        assert entry.top[0][0] == entry.token  # greedy: the chosen token is the most likely


def test_sampled_rows_score_the_logits_they_were_drawn_from(llm, reference):
    """After the temperature and the repetition penalty (transformers' processor), before top-k/top-p."""
    from transformers import RepetitionPenaltyLogitsProcessor

    params = SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.3, seed=3, max_new_tokens=8, logprobs=2)
    c = llm.generate([PROMPT], params)[0]
    ids = llm.encode(PROMPT) + c.token_ids
    logits, n = reference(ids), c.prompt_tokens
    penalty = RepetitionPenaltyLogitsProcessor(1.3)
    for j, entry in enumerate(c.logprobs):
        row = penalty(torch.tensor([ids[:n + j]]), torch.from_numpy(logits[n + j - 1][None]).float())[0].double()
        check(entry, log_softmax((row / 0.7).numpy()), ids[n + j], 2)


def test_scored_and_plain_rows_in_one_batch(llm):
    prompts = [PROMPT, "import os\n", "class Foo:\n    ", "for i in range("]
    plain = SamplingParams(max_new_tokens=16)
    scored = SamplingParams(max_new_tokens=16, logprobs=1, prompt_logprobs=0)
    alone = [llm.generate([p], plain)[0].token_ids for p in prompts]
    mixed = llm.generate(prompts, [scored, plain, scored, plain])
    assert [c.token_ids for c in mixed] == alone
    assert mixed[1].logprobs is None and len(mixed[0].logprobs) == 16
    seqs = [llm.make_sequence(p, sp) for p, sp in ((PROMPT, plain), (PROMPT, scored))]
    if llm.runner.has_next_token:  # the sampling head stays the path of rows that do not ask
        assert head_for(llm.runner, seqs[:1]) == "next_token"
    assert head_for(llm.runner, seqs) == "logits"


def test_top_ids_are_exact_with_ties():
    """The top-N search (candidates near the maximum first, rows of a batch together) equals a full sort, ties to
    the lower id, and every entry is the row's log-softmax."""
    from runtime.request.logprobs import score_rows

    rng = np.random.default_rng(0)
    peaked = rng.standard_normal(5000).astype(np.float32) * 3
    peaked[:40] += 12
    spike = rng.standard_normal(5000).astype(np.float32)
    spike[123] += 30  # fewer candidates near the maximum than asked for: the whole row is searched
    rows = np.stack([peaked, rng.standard_normal(5000).astype(np.float32), np.zeros(5000, np.float32), np.round(peaked),
                     spike])
    for k in (1, 5, 20):
        for row, entry in zip(rows, score_rows(rows, [7, 8, 9, 10, 11], [k] * 5)):
            expected = log_softmax(row.astype(np.float64))
            assert [t for t, _ in entry.top] == np.lexsort((np.arange(len(row)), -row))[:k].tolist()
            assert all(abs(lp - expected[t]) < 1e-6 for t, lp in entry.top + ((entry.token, entry.logprob),))


def test_refusals(llm):
    with pytest.raises(ValueError, match="logprobs must be None or an integer from 0 to 20"):
        SamplingParams(logprobs=21)
    with pytest.raises(RequestError, match="speculation"):
        llm.make_sequence(PROMPT, SamplingParams(logprobs=1), Speculation("ngram"))


# -- engine-serve -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(llm):
    running = RunningServer(create_app({"trained": llm}))
    yield running
    running.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "trained", **body}, timeout=60)


def stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json={"model": "trained", "stream": True, **body},
                      timeout=60) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completions_echo_scores_prompt_and_continuation(server, llm, reference):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 4, "echo": True}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    c = llm.generate([PROMPT], SamplingParams(max_new_tokens=6))[0]
    ids = llm.encode(PROMPT) + c.token_ids
    lp = log_softmax(reference(ids))
    got = choice["logprobs"]
    assert choice["text"] == PROMPT + c.text and got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert len(got["tokens"]) == len(ids) and "".join(got["tokens"]) == choice["text"]
    assert got["text_offset"] == [sum(len(t) for t in got["tokens"][:i]) for i in range(len(ids))]
    for i in range(1, len(ids)):
        assert abs(got["token_logprobs"][i] - lp[i - 1, ids[i]]) < TOL
        assert len(got["top_logprobs"][i]) == 4 and max(got["top_logprobs"][i].values()) == pytest.approx(lp[i - 1].max(), abs=TOL)
    chunks = stream(server, "/v1/completions", body)  # the same, streamed: the echo first, then each token
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == choice["text"]
    streamed = [x for ch in chunks if ch["choices"][0]["logprobs"] for x in ch["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == got["token_logprobs"]
    offsets = [x for ch in chunks if ch["choices"][0]["logprobs"] for x in ch["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == got["text_offset"]


def test_max_tokens_zero_scores_the_prompt_alone(server, llm, reference):
    body = {"prompt": PROMPT, "max_tokens": 0, "logprobs": 1, "echo": True}
    r = post(server, "/v1/completions", body).json()
    choice, ids = r["choices"][0], llm.encode(PROMPT)
    lp = log_softmax(reference(ids))
    assert choice["text"] == PROMPT and r["usage"]["completion_tokens"] == 0 and len(choice["logprobs"]["tokens"]) == len(ids)
    assert all(abs(choice["logprobs"]["token_logprobs"][i] - lp[i - 1, ids[i]]) < TOL for i in range(1, len(ids)))
    for bad in ({"max_tokens": 0}, {"max_tokens": 0, "echo": True, "stream": True}):
        r = post(server, "/v1/completions", {"prompt": "x", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_chat_logprobs_streamed_and_not(server, llm, reference):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    choice = post(server, "/v1/chat/completions", body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    ids = llm.chat_prompt_ids(messages)
    out = llm.generate([ids], SamplingParams(max_new_tokens=5))[0].token_ids
    lp = log_softmax(reference(ids + out))
    assert len(content) == 5
    for j, entry in enumerate(content):
        row = lp[len(ids) + j - 1]
        assert abs(entry["logprob"] - row[out[j]]) < TOL and len(entry["top_logprobs"]) == 3
        assert bytes(entry["bytes"]).decode() == entry["token"]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(np.sort(row)[::-1][:3].tolist(), abs=TOL)
    chunks = stream(server, "/v1/chat/completions", body)
    streamed = [e for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
                for e in ch["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    r = post(server, "/v1/chat/completions", {"messages": messages, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_loglikelihood_as_lm_eval_local_completions_asks(server, llm, reference):
    """lm-evaluation-harness's local-completions loglikelihood request (token ids, echo, logprobs 1, max_tokens 0)
    read as its parse_logprobs reads it: the continuation's summed logprob and whether it is greedy equal
    transformers' on the same weights."""
    context, continuation = llm.encode("def add(a, b):\n    return"), llm.encode(" a + b\n")
    body = {"prompt": context + continuation, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    n = len(context)
    tokens, tops = choice["logprobs"]["token_logprobs"][n:], choice["logprobs"]["top_logprobs"][n:]
    greedy = all(t == max(top.values()) for t, top in zip(tokens, tops))
    ids = context + continuation
    lp = log_softmax(reference(ids))
    expected = [lp[i - 1, ids[i]] for i in range(n, len(ids))]
    assert sum(tokens) == pytest.approx(sum(expected), abs=TOL * len(expected))
    assert greedy == all(lp[i - 1].argmax() == ids[i] for i in range(n, len(ids)))
