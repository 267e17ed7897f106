"""The runtime API and engine-run: loading checks, request validation, sampling, streaming, chat."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from runtime.cli import main as run_cli
from runtime.engine import LLM, RequestError
from runtime.manifest.load import EngineError
from runtime.request.params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return LLM(tiny_engine)


def copy_engine(tiny_engine, tmp_path):
    return shutil.copytree(tiny_engine, tmp_path / "engine")


def test_tampered_weights_rejected(tiny_engine, tmp_path):
    engine = copy_engine(tiny_engine, tmp_path)
    data = bytearray((engine / "model.onnx.data").read_bytes())
    data[5000] ^= 0xFF
    (engine / "model.onnx.data").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="sha256 differs"):
        LLM(engine)


def test_truncated_weights_rejected(tiny_engine, tmp_path):
    engine = copy_engine(tiny_engine, tmp_path)
    data = (engine / "model.onnx.data").read_bytes()
    (engine / "model.onnx.data").write_bytes(data[:len(data) // 2])
    with pytest.raises(EngineError, match="truncated"):
        LLM(engine)


def test_incompatible_format_rejected(tiny_engine, tmp_path):
    engine = copy_engine(tiny_engine, tmp_path)
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["format_version"] = 99
    (engine / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="format version 99.*rebuild"):
        LLM(engine)


def test_too_long_prompt_rejected_before_work(llm):
    with pytest.raises(RequestError, match="at most 96 tokens"):
        llm.generate([[5] * 10, [5] * 200])


def test_max_new_tokens_overflow_rejected(llm):
    with pytest.raises(RequestError, match=r"90 prompt tokens \+ max_new_tokens 10 = 100 exceeds max_seq_len 96"):
        llm.generate([[5] * 90], SamplingParams(max_new_tokens=10))


def test_invalid_sampling_values_named():
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"),
                          ({"top_k": -2}, "top_k"), ({"repetition_penalty": 0}, "repetition_penalty"),
                          ({"max_new_tokens": 0}, "max_new_tokens")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_empty_prompt_and_bad_token_ids_rejected(llm):
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[1, 100000]])


def test_load_time_limits_are_tunable(tiny_engine):
    small = LLM(tiny_engine, max_batch_size=2, max_seq_len=32)
    assert small.runner.cache.keys[0].shape == (2, 2, 32, 16)
    large = LLM(tiny_engine, max_seq_len=200)  # above the build limit, below max_position_embeddings
    assert large.generate([[5] * 150], SamplingParams(max_new_tokens=20, ignore_eos=True))[0].finish_reason == "length"
    with pytest.raises(EngineError, match="position limit"):
        LLM(tiny_engine, max_seq_len=10_000)


def test_more_prompts_than_slots_and_ragged_results(llm, tiny_engine):
    prompts = [[7 + i] * (3 + i) for i in range(7)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    batched = llm.generate(prompts, params)
    alone = [LLM(tiny_engine, max_batch_size=1).generate([p], params)[0] for p in prompts[:2]]
    assert [r.token_ids for r in batched[:2]] == [r.token_ids for r in alone]
    assert all(len(r.token_ids) == 6 and r.prompt_tokens == len(p) for r, p in zip(batched, prompts))


def test_seeded_sampling_reproducible_and_seed_sensitive(llm):
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=s, max_new_tokens=16, ignore_eos=True)
              for s in (1, 1, 2)]
    a, b, c = llm.generate(["def f(x):"] * 3, params)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_repetition_penalty_changes_greedy_output(llm):
    plain, penalized = llm.generate(["import os"] * 2, [SamplingParams(max_new_tokens=24, ignore_eos=True),
                                                      SamplingParams(max_new_tokens=24, ignore_eos=True,
                                                                     repetition_penalty=5.0)])
    counts = [max(np.bincount(r.token_ids)) for r in (plain, penalized)]
    assert counts[1] <= counts[0] and plain.token_ids != penalized.token_ids


def test_stream_concatenates_to_generate(llm):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert "".join(llm.stream("class A:", params)) == llm.generate(["class A:"], params)[0].text


def test_stop_string_ends_generation(llm):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    full = llm.generate(["x = 1"], params)[0]
    stop = full.text[5:8]
    assert stop, full.text
    stopped = llm.generate(["x = 1"], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:full.text.index(stop)]


def test_eos_stops_generation(llm):
    greedy = llm.generate(["def"], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    eos = greedy.token_ids[3]
    llm.eos_ids = frozenset({eos})
    try:
        result = llm.generate(["def"], SamplingParams(max_new_tokens=10))[0]
    finally:
        llm.eos_ids = frozenset(llm.manifest["model"]["tokens"]["eos_token_ids"])
    assert result.finish_reason == "stop" and result.token_ids == greedy.token_ids[:greedy.token_ids.index(eos) + 1]


def test_engine_run_cli(tiny_engine):
    runner = CliRunner()
    out = runner.invoke(run_cli, ["--engine", str(tiny_engine), "--prompt", "def", "--max-new-tokens", "8",
                                  "--ignore-eos"])
    assert out.exit_code == 0, out.output
    streamed = runner.invoke(run_cli, ["--engine", str(tiny_engine), "--max-new-tokens", "8", "--stream",
                                       "--ignore-eos"], input="def")
    assert streamed.output == out.output
    chat = runner.invoke(run_cli, ["--engine", str(tiny_engine), "--prompt", "hi", "--chat", "--max-new-tokens", "4"])
    assert chat.exit_code == 0, chat.output
    bad = runner.invoke(run_cli, ["--engine", str(tiny_engine), "--prompt", "x", "--temperature", "-1"])
    assert bad.exit_code == 2 and "temperature" in bad.output


def test_chat_template_matches_transformers(llm, tiny_checkpoint):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ref = AutoTokenizer.from_pretrained(str(tiny_checkpoint)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert llm.apply_chat_template(messages) == ref
