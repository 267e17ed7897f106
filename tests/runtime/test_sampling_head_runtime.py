"""Sampling in the graph, runtime side: decode reads the engine's ArgMax ids or TopK candidates when they
suffice and full logits otherwise, with the same tokens as an engine without the head."""
from __future__ import annotations

import numpy as np
import pytest

from builder.build import build_engine
from builder.recipe import load_recipe
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.request.sampler import candidates_suffice, sample, sample_candidates

K = 8


def build(checkpoint, out, *overrides):
    recipe = load_recipe(base={"model": str(checkpoint)},
                         overrides=["limits.max_seq_len=64", "limits.max_batch_size=4", *overrides])
    return build_engine(recipe, out, log=lambda _: None)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    return (build(tiny_checkpoint, root / "head", f"sampling_head.max_top_k={K}"),
            build(tiny_checkpoint, root / "plain", "sampling_head.enabled=false"))


def test_runner_reads_the_head_outputs(engines):
    llm = LLM(engines[0])
    runner = llm.runner
    assert runner.has_next_token and runner.top_k == K
    tokens, past = np.array([5, 9]), np.array([0, 0])
    logits = runner.decode(0, tokens, past)
    np.testing.assert_array_equal(runner.decode(0, tokens, past, "next_token"), logits.argmax(-1))
    values, ids = runner.decode(0, tokens, past, "topk")
    np.testing.assert_array_equal(np.take_along_axis(logits, ids, -1), values)
    assert (np.sort(logits, -1)[:, ::-1][:, :K] == values).all()
    llm.close()


def test_engine_without_head_refuses_head_calls(engines):
    llm = LLM(engines[1])
    assert not llm.runner.has_next_token and llm.runner.top_k == 0
    with pytest.raises(ValueError, match="no sampling head"):
        llm.runner.decode(0, np.array([5]), np.array([0]), "next_token")
    llm.close()


@pytest.mark.parametrize("kv_backend", ["numpy", "ortvalue"])
def test_same_tokens_with_and_without_the_head(engines, kv_backend):
    prompts = [[7 + i] * (2 + 4 * i) for i in range(4)]
    cases = [SamplingParams(max_new_tokens=10, ignore_eos=True),  # next_token
             [SamplingParams(temperature=0.8, top_k=k, top_p=0.9, seed=s, max_new_tokens=10, ignore_eos=True)
              for s, k in enumerate([1, 3, K, 5])],  # topk
             [SamplingParams(temperature=0.8, top_k=0, seed=3, max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=10, ignore_eos=True, repetition_penalty=1.3)] * 2]  # logits
    head, plain = LLM(engines[0], kv_backend=kv_backend), LLM(engines[1])
    for params in cases:
        assert ([r.token_ids for r in head.generate(prompts, params)]
                == [r.token_ids for r in plain.generate(prompts, params)])
    head.close(), plain.close()


def test_candidate_draws_equal_full_vocabulary_draws():
    rng = np.random.default_rng(0)
    for trial in range(200):
        logits = rng.standard_normal(300).astype(np.float32) * 3
        params = SamplingParams(temperature=0.7, top_k=int(rng.integers(1, K + 1)), top_p=0.8, seed=trial)
        assert candidates_suffice(params, K)
        ids = np.argsort(-logits, kind="stable")[:K]
        full = sample(logits[None], [params], [None], [np.random.default_rng(trial)])[0]
        assert sample_candidates(logits[ids], ids, params, np.random.default_rng(trial)) == full
    assert not candidates_suffice(SamplingParams(temperature=1.0, top_k=K + 1), K)
    assert not candidates_suffice(SamplingParams(temperature=1.0, top_k=4, repetition_penalty=1.1), K)
    assert not candidates_suffice(SamplingParams(), K)


def test_a_failed_candidate_draw_ends_only_its_row_once(engines, monkeypatch):
    """A row whose draw from the TopK candidates fails ends with "error" (counted once); the others go on."""
    import runtime.batching.decode as decode

    def draw(values, ids, params, rng):
        if params.seed == 1:
            raise ValueError("bad draw")
        return sample_candidates(values, ids, params, rng)

    monkeypatch.setattr(decode, "sample_candidates", draw)
    llm = LLM(engines[0])
    params = [SamplingParams(temperature=0.8, top_k=3, seed=s, max_new_tokens=6, ignore_eos=True) for s in range(3)]
    results = llm.generate([[7, 8], [9, 10], [11, 12]], params)
    assert [r.finish_reason for r in results] == ["length", "error", "length"]
    assert "bad draw" in results[1].error and [len(r.token_ids) for r in results] == [6, 1, 6]
    assert llm.executor.stats()["finished"] == 3
    llm.close()



def test_a_greedy_call_asks_topk_for_one_candidate(engines, monkeypatch, tmp_path):
    """ONNX Runtime runs TopK whatever a call fetches (only_execute_path_to_fetches works in training builds
    only): a call that reads next_token passes top_k = 1, one that reads the candidates K (profiler shapes)."""
    import json

    import runtime.model.model_runner as model_runner

    options = model_runner.session_options

    def profiled(*args, **kwargs):
        chosen = options(*args, **kwargs)
        chosen.enable_profiling, chosen.profile_file_prefix = True, str(tmp_path / "head")
        return chosen

    monkeypatch.setattr(model_runner, "session_options", profiled)
    llm = LLM(engines[0])
    tokens, past = np.array([5, 9]), np.array([0, 0])
    llm.runner.decode(0, tokens, past, "next_token")
    llm.runner.decode(0, tokens, past, "topk")
    events = json.loads(open(llm.runner.session.end_profiling()).read())
    llm.close()
    shapes = [e["args"]["output_type_shape"] for e in events
              if e.get("cat") == "Node" and e["args"].get("op_name") == "TopK" and e["name"].endswith("kernel_time")]
    assert [list(s[0].values())[0] for s in shapes] == [[2, 1], [2, K]]
