"""LoRA serving against transformers + PEFT on the same weights: logits within 1e-4 and identical greedy tokens
for every target module, fused and unfused projections, rsLoRA; a batch mixing the base and three adapters gives
each request its solo tokens; load/unload while requests run; refusals name their field."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from lora_helpers import ALL, build_lora_engine, make_adapter, reference_greedy, reference_logits
from runtime import LLM, SamplingParams
from runtime.lora.adapters import AdapterError
from runtime.request.validate import RequestError

PROMPT = [1, 17, 33, 250, 7, 91, 402, 5, 66]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory):
    return build_lora_engine(tiny_checkpoint, tmp_path_factory.mktemp("lora") / "engine")


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"all": make_adapter(tiny_checkpoint, root / "all", seed=1),
            "attn": make_adapter(tiny_checkpoint, root / "attn", r=8, alpha=16, targets=["q_proj", "v_proj"], seed=2),
            "rs": make_adapter(tiny_checkpoint, root / "rs", r=2, alpha=4, targets=["o_proj", "down_proj", "up_proj"],
                               use_rslora=True, seed=3)}


def engine_logits(llm: LLM, name: str | None, ids: list[int]) -> np.ndarray:
    llm.runner.lora.assign(0, name)
    return llm.runner.extend(0, 0, ids, all_logits=True)


def test_manifest_records_the_lora_inputs(engine):
    lora = json.loads((engine / "manifest.json").read_text())["lora"]
    assert (lora["max_rank"], lora["max_adapters"], lora["targets"]) == (8, 3, ALL)
    assert [lin["modules"] for lin in lora["linears"][:3]] == [["q_proj", "k_proj", "v_proj"], ["o_proj"],
                                                               ["gate_proj", "up_proj"]]


@pytest.mark.parametrize("name", ["all", "attn", "rs"])
def test_logits_match_peft(engine, adapters, tiny_checkpoint, name):
    with LLM(engine, adapters={name: adapters[name]}) as llm:
        got = engine_logits(llm, name, PROMPT)
        base = engine_logits(llm, None, PROMPT)
    want = reference_logits(tiny_checkpoint, adapters[name], PROMPT)
    assert np.abs(want - reference_logits(tiny_checkpoint, None, PROMPT)).max() > 1e-2  # the adapter matters
    np.testing.assert_allclose(got, want, atol=1e-4)
    np.testing.assert_allclose(base, reference_logits(tiny_checkpoint, None, PROMPT), atol=1e-4)


def test_unfused_projections_match_peft(tiny_checkpoint, adapters, tmp_path):
    engine = build_lora_engine(tiny_checkpoint, tmp_path / "unfused", fuse=False)
    with LLM(engine, adapters={"all": adapters["all"]}) as llm:
        got = engine_logits(llm, "all", PROMPT)
    np.testing.assert_allclose(got, reference_logits(tiny_checkpoint, adapters["all"], PROMPT), atol=1e-4)


def test_mixed_batch_gives_each_request_its_solo_greedy_tokens(engine, adapters, tiny_checkpoint):
    names = [None, "all", "attn", "rs"]
    with LLM(engine, adapters=adapters) as llm:
        assert llm.adapters == ["all", "attn", "rs"]
        params = [SamplingParams(max_new_tokens=6, ignore_eos=True, adapter=n) for n in names]
        batch = llm.generate([PROMPT] * 4, params)
        solo = [llm.generate([PROMPT], p)[0] for p in params]
    for name, b, s in zip(names, batch, solo):
        assert b.token_ids == s.token_ids
        assert list(b.token_ids) == reference_greedy(tiny_checkpoint, adapters.get(name), PROMPT, 6)
    assert len({tuple(b.token_ids) for b in batch}) > 1


def test_unknown_adapter_is_refused_naming_the_loaded_ones(engine, adapters):
    with LLM(engine, adapters={"all": adapters["all"]}) as llm:
        with pytest.raises(ValueError, match=r"'nope' is not loaded; loaded adapters: \['all'\]"):
            llm.generate([PROMPT], SamplingParams(adapter="nope"))
        assert llm.generate([PROMPT], SamplingParams(max_new_tokens=2, adapter="all"))[0].token_ids


def test_unload_waits_for_running_requests_and_frees_the_slot(engine, adapters, tiny_checkpoint):
    with LLM(engine, adapters={"all": adapters["all"]}) as llm:
        handle = llm.submit(PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True, adapter="all"))
        unloader = threading.Thread(target=llm.unload_adapter, args=("all",))
        unloader.start()
        result = handle.result()
        unloader.join(timeout=30)
        assert not unloader.is_alive() and llm.adapters == []
        assert list(result.token_ids) == reference_greedy(tiny_checkpoint, adapters["all"], PROMPT, 20)
        with pytest.raises(ValueError, match="not loaded"):
            llm.submit(PROMPT, SamplingParams(adapter="all"))
        llm.load_adapter("rs", adapters["rs"])  # the freed slot takes another
        assert llm.adapters == ["rs"]


def test_unload_does_not_wait_for_a_request_that_was_never_queued(engine, adapters):
    """A sequence validated on the adapter but never queued (its submit failed, or a server's later check
    refused its batch) holds no unload: it returns at once, not at a timeout."""
    with LLM(engine, adapters={"all": adapters["all"]}) as llm:
        llm.make_sequence(PROMPT, SamplingParams(max_new_tokens=4, adapter="all"))
        start = time.monotonic()
        llm.unload_adapter("all", timeout=10)
        assert time.monotonic() - start < 2 and llm.adapters == []


def test_submit_after_its_adapter_was_unloaded_is_a_request_error(engine, adapters):
    """A sequence validated on an adapter that is unloaded before it is queued: submitting it is refused as a
    RequestError naming the adapter (a server's 400, not a worker's crash), and the engine keeps serving."""
    with LLM(engine, adapters={"all": adapters["all"]}) as llm:
        seq = llm.make_sequence(PROMPT, SamplingParams(max_new_tokens=4, adapter="all"))
        llm.unload_adapter("all", timeout=10)
        with pytest.raises(RequestError, match="adapter 'all' is not loaded") as err:
            llm.executor.submit_sequence(seq)
        assert err.value.field == "adapter"
        assert len(llm.generate([PROMPT], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_a_refused_sequence_in_a_batch_cancels_those_queued_before_it(engine, adapters):
    """submit_sequences queues a batch at once or not at all: the second sequence's adapter unloaded since its
    validation, the batch is refused as that RequestError and the first one, already queued, ends cancelled
    without a token generated; the engine keeps serving."""
    with LLM(engine, adapters={"all": adapters["all"]}) as llm:
        plain = llm.make_sequence(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
        on_adapter = llm.make_sequence(PROMPT, SamplingParams(max_new_tokens=4, adapter="all"))
        llm.unload_adapter("all", timeout=10)
        with pytest.raises(RequestError, match="adapter 'all' is not loaded"):
            llm.executor.submit_sequences([plain, on_adapter])
        assert len(llm.generate([PROMPT], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids) == 3
        assert plain.finish_reason == "cancelled" and plain.output_ids == []
        assert llm.executor.stats()["generated_tokens"] == 3


def test_more_adapters_than_slots_wait_for_a_slot_and_get_their_own_tokens(engine, adapters, tiny_checkpoint,
                                                                          tmp_path):
    """3 device slots, 4 adapters loaded: the least recently used idle one goes back to the host, a request on
    an adapter without a slot waits until one frees, and every request gets its solo (reference) tokens."""
    extra = make_adapter(tiny_checkpoint, tmp_path / "extra", seed=9, targets=["k_proj", "gate_proj"])
    everything = dict(adapters, extra=extra)
    with LLM(engine, adapters=everything) as llm:
        assert llm.adapters == ["all", "attn", "rs", "extra"] and llm.runner.lora.resident == ["all", "attn", "rs"]
        names = ["extra", "all", None, "attn", "rs", "extra"]
        params = [SamplingParams(max_new_tokens=5, ignore_eos=True, adapter=n) for n in names]
        results = llm.generate([PROMPT] * len(names), params)
        assert "extra" in llm.runner.lora.resident
    for name, result in zip(names, results):
        assert list(result.token_ids) == reference_greedy(tiny_checkpoint, everything.get(name), PROMPT, 5), name


@pytest.mark.parametrize("change, field", [
    ({"use_dora": True}, "use_dora"), ({"bias": "lora_only"}, "bias"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"layers_to_transform": [0]}, "layers_to_transform"), ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"r": 16}, "max_rank")])
def test_unsupported_adapter_configs_are_refused_by_name(engine, adapters, tmp_path, change, field):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(adapters["all"], bad)
    config = json.loads((bad / "adapter_config.json").read_text()) | change
    (bad / "adapter_config.json").write_text(json.dumps(config))
    with LLM(engine, adapters={"all": adapters["all"]}) as llm:
        with pytest.raises(AdapterError, match=field):
            llm.load_adapter("bad", bad)
        assert llm.adapters == ["all"]


def test_targets_outside_the_engine_are_refused(tiny_checkpoint, adapters, tmp_path):
    engine = build_lora_engine(tiny_checkpoint, tmp_path / "qv", targets=["q_proj", "v_proj"])
    with LLM(engine) as llm:
        with pytest.raises(AdapterError, match=r"target_modules \['down_proj', 'o_proj', 'up_proj'\] are not ones this engine was built with"):
            llm.load_adapter("rs", adapters["rs"])
        llm.load_adapter("attn", adapters["attn"])
        assert llm.adapters == ["attn"]


LONG = [1] + [(7 * i + 3) % 500 + 2 for i in range(40)]  # three full 16-token blocks and more


def test_prefix_reuse_never_crosses_adapters(engine, adapters, tiny_checkpoint):
    params = {n: SamplingParams(max_new_tokens=4, ignore_eos=True, adapter=n) for n in (None, "all", "attn")}
    with LLM(engine, adapters=adapters, block_size=16) as llm:
        first = llm.generate([LONG], params["all"])[0]
        again = llm.generate([LONG], params["all"])[0]
        others = {n: llm.generate([LONG], params[n])[0] for n in (None, "attn")}
    assert again.metrics["reused_prompt_tokens"] > 0 and again.token_ids == first.token_ids  # same adapter: reused
    for name, out in others.items():
        assert out.metrics["reused_prompt_tokens"] == 0
        assert list(out.token_ids) == reference_greedy(tiny_checkpoint, adapters.get(name), LONG, 4)


def test_ngram_speculation_with_an_adapter_gives_its_plain_tokens(engine, adapters):
    from runtime.speculation.speculator import Speculation

    prompt = PROMPT * 3  # repeats: the n-gram lookup has drafts to offer
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, adapter="all")
    with LLM(engine, adapters={"all": adapters["all"]}) as llm:
        plain = llm.generate([prompt], params)[0]
        speculated = llm.generate([prompt], params, speculation=Speculation(method="ngram", fallback=False))[0]
    assert speculated.token_ids == plain.token_ids
    assert speculated.metrics["speculation"]["drafted"] > 0


def test_engine_run_loads_and_uses_an_adapter(engine, adapters):
    from click.testing import CliRunner

    from runtime.cli import main

    text = "hello world"
    with LLM(engine, adapters={"all": adapters["all"]}) as llm:
        want = llm.generate([text], SamplingParams(max_new_tokens=5, ignore_eos=True, adapter="all"))[0].text
    args = ["--engine", str(engine), "--prompt", text, "--no-echo", "--max-new-tokens", "5", "--ignore-eos"]
    out = CliRunner().invoke(main, args + ["--adapter", f"all={adapters['all']}", "--use-adapter", "all"])
    assert out.exit_code == 0, out.output
    assert out.output.rstrip("\n") == want
    bad = CliRunner().invoke(main, args + ["--adapter", "nopath"])
    assert bad.exit_code == 2 and "expected NAME=PATH" in bad.output
    unknown = CliRunner().invoke(main, args + ["--use-adapter", "sql"])
    assert unknown.exit_code == 2 and "'sql' is not loaded" in unknown.output
