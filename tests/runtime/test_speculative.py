"""Speculative decoding: prompt lookup and draft-model drafts verified in one target call, inside the
in-flight batching executor. Greedy output must equal plain decoding token for token; with sampling
the rejection rule must keep the target distribution."""
from __future__ import annotations

import time

import numpy as np
import pytest

from builder.build import build_engine
from builder.recipe import load_recipe
from runtime.engine import LLM, RequestError
from runtime.request.params import SamplingParams
from runtime.speculation.draft_policy import MAX_PAUSE, PROBE_EVERY, StepCosts
from runtime.speculation.speculator import NgramIndex, SpecState, Speculation, Speculator, accept, ngram_draft
from tools.checkpoints.make_checkpoint import make_checkpoint


def test_ngram_draft_copies_what_followed_latest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2]
    assert ngram_draft(tokens, 3) == [3, 7, 8]          # latest "1 2" is followed by 3 7 8
    assert ngram_draft([4, 5, 6], 2) == []
    assert ngram_draft([5, 1, 5], 4) == [1, 5, 1, 5]    # unigram fallback; what runs into the end repeats
    assert ngram_draft([7, 1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]  # a loop of period 3 goes on


def _lookup_by_scan(tokens: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:  # look up again on tokens + draft until k tokens are drafted
            draft = tokens[starts[-1] + n:starts[-1] + n + k]
            return draft + _lookup_by_scan(tokens + draft, k - len(draft), ngram_max, n) if len(draft) < k else draft
    return []


@pytest.mark.parametrize("ngram_min,ngram_max", [(1, 3), (2, 4)])
def test_ngram_index_grown_step_by_step_matches_a_full_scan(ngram_min, ngram_max):
    rng = np.random.default_rng(ngram_max)
    tokens = rng.integers(0, 6, size=40).tolist()  # a small alphabet: many repeats
    index = NgramIndex(ngram_max)
    while len(tokens) < 400:
        k = int(rng.integers(1, 6))
        assert index.draft(tokens, k, ngram_min) == _lookup_by_scan(tokens, k, ngram_max, ngram_min)
        tokens += rng.integers(0, 6, size=int(rng.integers(1, 4))).tolist()  # 1-3 tokens per step, like a verify


def test_adaptive_draft_length():
    state = SpecState(Speculation(num_draft=4, max_draft=6))
    state.record(4, 4)
    assert state.k == 5
    state.record(5, 1)
    assert state.k == 4 and state.drafted == 9 and state.accepted == 5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rejection_sampling_keeps_target_distribution(temperature):
    """Many draws on an 8-token vocabulary: the first two emitted tokens follow p, not q."""
    rng = np.random.default_rng(0)
    vocab, n = 8, 40000
    target = rng.normal(size=(3, vocab)).astype(np.float32) * 1.5
    draft_logits = rng.normal(size=(2, vocab)) * 1.5
    params = SamplingParams(temperature=temperature)
    p = np.exp(target / temperature)
    p /= p.sum(-1, keepdims=True)
    q = np.exp(draft_logits)
    q /= q.sum(-1, keepdims=True)
    first, second = np.zeros(vocab), np.zeros(vocab)
    for _ in range(n):
        drafts = [int(rng.choice(vocab, p=q[0])), int(rng.choice(vocab, p=q[1]))]
        out = accept(params, target, drafts, [q[0], q[1]], [], rng)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        expected = counts.sum() * probs
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 24.3, (chi2, counts / counts.sum(), probs)  # 7 dof, p = 0.001


def test_greedy_accept_keeps_argmax_prefix():
    logits = np.eye(5, dtype=np.float32)[[2, 3, 1]] * 5
    assert accept(SamplingParams(), logits, [2, 3], None, [], np.random.default_rng()) == [2, 3, 1]
    assert accept(SamplingParams(), logits, [2, 4], None, [], np.random.default_rng()) == [2, 3]
    # with a repetition penalty each row's argmax counts the tokens accepted before it
    penalised = np.array([[0.0, 2.0, 1.9], [0.0, 2.0, 1.9]], dtype=np.float32)
    assert accept(SamplingParams(), penalised, [1], None, [], np.random.default_rng()) == [1, 1]
    assert accept(SamplingParams(repetition_penalty=1.5), penalised, [1], None, [], np.random.default_rng()) == [1, 2]


@pytest.fixture(scope="module")
def draft_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    ckpt = make_checkpoint(root / "ckpt", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=64, initializer_range=0.1, seed=9)
    recipe = load_recipe(base={"model": str(ckpt)}, overrides=["limits.max_seq_len=96", "verify.enabled=off"])
    return build_engine(recipe, root / "engine", log=lambda _: None)


def repetitive_prompt():
    return [10, 11, 12, 13, 14, 15] * 4 + [10, 11]


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_greedy_speculation_identical_to_plain(tiny_engine, draft_engine, method):
    draft = {"ngram": None, "draft": draft_engine, "self": tiny_engine}[method]
    llm = LLM(tiny_engine, draft=draft)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = [repetitive_prompt(), [3, 4, 5, 6, 3, 4], list(range(30, 50))]
    plain = llm.generate(prompts, params)
    spec = llm.generate(prompts, params, speculation=Speculation("ngram" if method == "ngram" else "draft"))
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    stats = [r.metrics["speculation"] for r in spec]
    assert sum(s["drafted"] for s in stats) > 0
    if method == "self":  # the target drafting for itself: every draft is accepted
        assert all(s["acceptance_rate"] == 1.0 for s in stats)
    llm.close()


def test_process_thread_pool(tiny_engine, draft_engine):
    """Opt-in: a target and its draft on ONNX Runtime's process-wide pool give the same tokens as on
    pools of their own, and every later session of the process runs on that pool too (ONNX Runtime's
    rule). In a child process: the switch cannot be undone in this one."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        from runtime.engine import LLM
        from runtime.request.params import SamplingParams
        from runtime.speculation.speculator import Speculation
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        prompt = {repetitive_prompt()!r}
        def run(llm):
            return llm.generate([prompt], params, speculation=Speculation("draft"))[0].token_ids
        own = LLM({str(tiny_engine)!r}, draft={str(draft_engine)!r})
        assert not own.runner.on_process_pool
        expected = run(own)
        shared = LLM({str(tiny_engine)!r}, draft={str(draft_engine)!r}, process_thread_pool=True)
        assert shared.runner.on_process_pool and shared.draft_runner.on_process_pool
        assert run(shared) == expected
        later = LLM({str(tiny_engine)!r}, threads=1)
        assert later.runner.on_process_pool and later.generate([prompt], params)[0].token_ids
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_mixed_speculation_in_one_batch(tiny_engine, draft_engine):
    llm = LLM(tiny_engine, draft=draft_engine, max_tokens_per_step=16)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = [repetitive_prompt(), list(range(40, 60)), [7, 8, 9] * 5, list(range(100, 130))]
    plain = llm.generate(prompts, params)
    methods = [Speculation("ngram"), Speculation("draft", num_draft=3), None, Speculation("draft")]
    handles = [llm.submit(p, params, m) for p, m in zip(prompts, methods)]
    assert [h.result(timeout=60).token_ids for h in handles] == [r.token_ids for r in plain]
    assert sorted(llm.executor.scheduler.slots.free) == [0, 1, 2, 3]
    llm.close()


def test_sampled_speculation_runs_and_respects_limits(tiny_engine, draft_engine):
    llm = LLM(tiny_engine, draft=draft_engine)
    params = SamplingParams(max_new_tokens=30, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    result = llm.generate([repetitive_prompt()], params, speculation=Speculation("draft"))[0]
    again = llm.generate([repetitive_prompt()], params, speculation=Speculation("draft"))[0]
    assert len(result.token_ids) == 30 and result.token_ids == again.token_ids  # seeded: reproducible
    assert 0 <= result.metrics["speculation"]["acceptance_rate"] <= 1
    llm.close()


def test_draft_method_without_draft_engine_rejected(tiny_engine):
    llm = LLM(tiny_engine)
    with pytest.raises(RequestError, match="draft engine"):
        llm.submit([1, 2, 3], SamplingParams(max_new_tokens=4), Speculation("draft"))
    with pytest.raises(ValueError, match="num_draft"):
        Speculation("ngram", num_draft=0)


def test_engine_run_speculation_options(tiny_engine):
    from click.testing import CliRunner

    from runtime.cli import main as run_cli

    args = ["--engine", str(tiny_engine), "--prompt", "a b c a b c a b", "--max-new-tokens", "12", "--ignore-eos"]
    plain = CliRunner().invoke(run_cli, args)
    spec = CliRunner().invoke(run_cli, args + ["--speculate", "draft", "--draft", str(tiny_engine), "--stats"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    assert "speculation draft" in spec.stderr and "(100%)" in spec.stderr


@pytest.mark.parametrize("section, expected", [("draft_model", "none"), ("self_draft", "int4_rtn"),
                                               ("draft_model+int4_rtn", "int4_rtn")])
def test_engine_build_builds_the_pair(tiny_checkpoint, tmp_path, section, expected):
    from runtime.manifest.load import load_manifest

    value = str(make_checkpoint(tmp_path / "draft_ckpt", hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=4)) \
        if section.startswith("draft_model") else "int4_rtn"
    quantized = [f"speculative.draft_quantization={expected}"] if "+" in section else []
    recipe = load_recipe(base={"model": str(tiny_checkpoint)}, overrides=[
        "limits.max_seq_len=96", "verify.enabled=off", f"speculative.{section.split('+')[0]}={value}", *quantized])
    engine = build_engine(recipe, tmp_path / "engine", log=lambda _: None)
    manifest = load_manifest(engine)
    assert manifest["speculative"]["draft_dir"] == "draft"
    draft_manifest = load_manifest(engine / "draft")
    assert draft_manifest["quantization"]["mode"] == expected
    llm = LLM(engine)  # picks up draft/ by itself
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = llm.generate([repetitive_prompt()], params)[0]
    spec = llm.generate([repetitive_prompt()], params, speculation=Speculation("draft"))[0]
    assert spec.token_ids == plain.token_ids and spec.metrics["speculation"]["drafted"] > 0
    llm.close()


def test_speculative_recipe_validation():
    from builder.recipe import RecipeError

    with pytest.raises(RecipeError, match="not both"):
        load_recipe(base={"model": "m"}, overrides=["speculative.draft_model=x", "speculative.self_draft=int8"])
    with pytest.raises(RecipeError, match="self_draft"):
        load_recipe(base={"model": "m"}, overrides=["speculative.self_draft=int3"])
    with pytest.raises(RecipeError, match="draft_quantization quantizes a draft_model"):
        load_recipe(base={"model": "m"}, overrides=["speculative.draft_quantization=int4_rtn"])
    with pytest.raises(RecipeError, match="draft_quantization"):
        load_recipe(base={"model": "m"}, overrides=["speculative.draft_model=x", "speculative.draft_quantization=q3"])


def test_step_costs_decide_whether_drafting_pays():
    costs = StepCosts(plain_rows={1: 1.0}, verifies={5: 1.2})
    state = SpecState(Speculation("ngram", num_draft=4))
    assert not StepCosts().drafting_pays(state)  # no plain decode measured yet: decode plainly, which measures it
    assert StepCosts(plain_rows={1: 1.0}).drafting_pays(state)  # no verify measured yet: draft
    assert state.recent_acceptance == 0.5    # the prior: nothing drafted yet
    set_acceptance(state, 0.9)               # E = (1 - 0.9^5) / 0.1 = 4.1 tokens for one verify
    assert costs.drafting_pays(state)
    set_acceptance(state, 0.1)               # E = 1.11 < 1.2
    assert not costs.drafting_pays(state)
    busy = StepCosts(plain_rows={1: 1.0, 4: 1.0}, verifies={5: 1.2})
    busy.observe_step_overhead(2.0)          # every step also costs 2.0 outside engine calls: it pays to need fewer
    assert busy.drafting_pays(state)         # 1.11 * (1.0 + 2.0) >= 1.2 + 2.0
    assert not busy.drafting_pays(state, rows=4)  # shared by 4 rows: 1.11 * 1.5 < 1.2 + 0.5
    draft = SpecState(Speculation("draft", num_draft=4))
    set_acceptance(draft, 0.9)               # 4.1 plain rows vs 1.2 + 4 draft steps of 0.5
    assert StepCosts(plain_rows={1: 1.0}, verifies={5: 1.2}, draft_step=0.5).drafting_pays(draft)
    set_acceptance(draft, 0.5)               # 1.94 vs 3.2
    assert not StepCosts(plain_rows={1: 1.0}, verifies={5: 1.2}, draft_step=0.5).drafting_pays(draft)
    set_acceptance(state, 0.5)               # E = 1.94: pays alone, not when 4 rows share a decode call
    shared = StepCosts(plain_rows={1: 1.0, 4: 0.3}, verifies={5: 1.2})
    assert shared.drafting_pays(state, rows=1) and not shared.drafting_pays(state, rows=4)
    shared.observe_plain(4, 2.0)             # a call of 4 rows took 2.0: 0.3 -> 0.34 per row
    assert shared.plain_rows[4] == pytest.approx(0.8 * 0.3 + 0.2 * 0.5)


def set_acceptance(state: SpecState, rate: float) -> None:
    state.recent_drafted, state.recent_accepted = 1000.0, 1000.0 * rate - (1 - 2 * rate)  # (acc + 1) / (dr + 2)


def test_recent_acceptance_follows_the_last_verifies():
    state = SpecState(Speculation("ngram", num_draft=4, adaptive=False))
    state.record(4, 0)
    assert state.recent_acceptance == pytest.approx(1 / 6)  # two rejections do not make it zero
    for _ in range(30):
        state.record(4, 4)
    assert state.recent_acceptance > 0.95 and state.acceptance_rate == pytest.approx(120 / 124)


class _Seq:
    def __init__(self, speculation: Speculation, params: SamplingParams):
        self.speculation, self.params = SpecState(speculation), params
        self.all_ids, self.output_ids, self.slot, self.rng = [], [], 0, None


def test_a_request_whose_drafting_does_not_pay_decodes_plainly_then_tries_again():
    speculator = Speculator(target=None)
    speculator.costs = StepCosts(plain_rows={1: 1.0}, verifies={5: 1.2})
    seq = _Seq(Speculation("ngram"), SamplingParams())
    set_acceptance(seq.speculation, 0.05)
    decisions = [speculator.should_draft(seq) for _ in range(800)]
    probes = [i for i, d in enumerate(decisions) if d]  # one draft re-measures, after pauses of 16, 32, ... 256
    pauses = [16, 32, 64, 128, 256, 256]
    assert PROBE_EVERY == 16 and MAX_PAUSE == 256
    assert probes == [sum(pauses[:i + 1]) + i for i in range(len(pauses))]
    assert seq.speculation.plain_steps == 800 - len(probes)
    set_acceptance(seq.speculation, 0.95)  # as a probe would measure it: drafting resumes at the next probe ...
    assert any(speculator.should_draft(seq) for _ in range(MAX_PAUSE + 1))
    assert all(speculator.should_draft(seq) for _ in range(8))
    set_acceptance(seq.speculation, 0.05)  # ... and a later fallback starts again from the shortest pause
    tries = [speculator.should_draft(seq) for _ in range(PROBE_EVERY + 1)]
    assert tries == [False] * PROBE_EVERY + [True]
    for spec, params in ((Speculation("ngram", fallback=False), SamplingParams()),
                         (Speculation("ngram"), SamplingParams(temperature=0.7, seed=1))):  # seeded: reproducible
        pinned = _Seq(spec, params)
        set_acceptance(pinned.speculation, 0.05)
        assert all(speculator.should_draft(pinned) for _ in range(PROBE_EVERY)) and pinned.speculation.plain_steps == 0


def test_tries_are_skipped_when_the_catch_up_costs_more_than_drafting_could_save():
    """A draft engine about as slow per token as the target (an int4 build of a model too small to be
    weight-bound) saves little even at full acceptance; a try costs a verify plus the draft's catch-up
    over everything decoded meanwhile (at a request's first draft: its whole prompt). Tries whose
    catch-up costs more than drafting could save over the rest of the request, at the best acceptance
    seen (this request's or every request's with that method), are skipped."""
    speculator = Speculator(target=None)
    costs = speculator.costs = StepCosts(plain_rows={1: 1.0}, verifies={n: 1.0 + 0.05 * n for n in range(2, 10)},
                                         draft_step=1.0, draft_prefill=0.1)
    seq = _Seq(Speculation("draft", max_draft=4), SamplingParams(max_new_tokens=100))
    seq.all_ids, seq.output_ids, seq.speculation.draft_cached = list(range(300)), [], 0
    assert costs.saving_per_token(seq.speculation) < 0     # (k + 1) * 1.0 < verify(k + 1) + k * 1.0 for every k
    assert not any(speculator.should_draft(seq) for _ in range(1000)) and seq.speculation.plain_steps == 1000
    costs.draft_step = 0.5                           # k = 4: 5 tokens for 1.25 + 2.0: 0.35 saved per token
    assert costs.saving_per_token(seq.speculation) == pytest.approx(0.35)
    assert costs.saving_per_token(seq.speculation, acceptance=0.5) < 0  # 1.94 tokens at best for 1.25 + 2.0
    costs.draft_prefill = 0.2                        # 300 tokens to catch up: 60 > 0.35 * 100 tokens left
    assert not any(speculator.should_draft(seq) for _ in range(1000))
    costs.draft_prefill = 0.1                        # 30 < 35: worth a try ...
    assert any(speculator.should_draft(seq) for _ in range(MAX_PAUSE + 1))
    costs.acceptance["draft"] = 0.5                  # ... not once every request's drafts are accepted half the time
    assert not any(speculator.should_draft(seq) for _ in range(1000))
    fresh = _Seq(Speculation("draft", max_draft=4), SamplingParams(max_new_tokens=100))
    fresh.all_ids, fresh.output_ids, fresh.speculation.draft_cached = list(range(300)), [], 0
    set_acceptance(fresh.speculation, 0.99)                 # drafting pays, but not the whole prompt's catch-up
    costs.draft_prefill = 0.2
    assert costs.drafting_pays(fresh.speculation) and not speculator.should_draft(fresh)
    caught_up = _Seq(Speculation("draft", max_draft=4), SamplingParams(max_new_tokens=100))
    caught_up.all_ids, caught_up.output_ids, caught_up.speculation.draft_cached = list(range(300)), [], 299
    caught_up.speculation.paused = 1  # a draft that kept up, no verify of its own: judged at the method's 0.5
    assert not speculator.should_draft(caught_up)
    set_acceptance(caught_up.speculation, 0.99)
    caught_up.speculation.paused = 1                        # its own verifies pay: its try goes ahead (and re-measures)
    assert speculator.should_draft(caught_up)
    ngram = _Seq(Speculation("ngram"), SamplingParams())  # drafts for free, nothing to catch up
    assert StepCosts(plain_rows={1: 1.0}, verifies={2: 1.9}).saving_per_token(ngram.speculation) > 0
    shared = StepCosts(plain_rows={16: 0.1}, verifies={n: 1.0 for n in range(2, 10)})  # 16 rows share a call:
    assert shared.saving_per_token(ngram.speculation, rows=16) < 0                     # 9 tokens: 0.9 < 1.0


class _SlowDraft:
    """A draft runner whose calls take 1 ms per token."""

    new_call_shapes = 0

    class spec:
        max_seq_len = 1000

    def extend(self, slot, start, tokens, all_logits=False, head="logits"):
        self.new_call_shapes += len(tokens) > 2  # a catch-up: a prompt-sized shape, new each time
        time.sleep(0.002 * len(tokens))
        return np.zeros((len(tokens), 8), dtype=np.float32)

    def decode(self, slot, tokens, past):
        time.sleep(0.002)
        return np.zeros((1, 8), dtype=np.float32)


def test_draft_step_timing_leaves_out_the_catch_up():
    speculator = Speculator(target=None, draft=_SlowDraft())
    seq = _Seq(Speculation("draft", num_draft=3), SamplingParams())
    seq.all_ids, seq.speculation.draft_cached = list(range(60)), 0  # the draft has not seen the prompt: a 60-token catch-up
    speculator._draft_tokens(seq, 3)
    # ~2 ms per step, not (60 + 2) * 2 / 3 ms = 41 ms (bounds wide enough for a machine under heavy load)
    assert 0.002 <= speculator.costs.draft_step < 0.015
    assert 0.002 <= speculator.costs.draft_prefill < 0.004  # ~2 ms per caught-up token, though its shape was new
    seq.all_ids, seq.speculation.draft_cached = list(range(64)), 62  # after a verify: 2 new tokens
    speculator._draft_tokens(seq, 3)
    assert speculator.costs.draft_step < 0.015


def test_runner_counts_the_call_shapes_it_binds(tiny_engine):
    """The first call of a shape binds its buffers and is slower than the next: cost timings skip it
    (a cold verify once measured at several times its cost kept a request from ever drafting again)."""
    llm = LLM(tiny_engine)
    runner, before = llm.runner, llm.runner.new_call_shapes
    runner.extend(0, 0, [5, 6, 7])
    runner.decode(0, np.array([8]), np.array([3]))
    assert runner.new_call_shapes == before + 2
    runner.decode(0, np.array([9]), np.array([4]))  # the same shape again
    assert runner.new_call_shapes == before + 2
    llm.close()


def test_fallback_keeps_greedy_output(tiny_engine):
    """Random prompts give prompt lookup little to copy: requests fall back to plain decoding for
    some steps, and the tokens stay those of plain decoding."""
    llm = LLM(tiny_engine)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    prompts = [list(range(40, 60)), [9, 300, 17, 250, 9, 300, 18, 251, 9]]
    plain = llm.generate(prompts, params)
    costs = StepCosts(plain_rows={n: 1.0 for n in range(1, 5)}, verifies={2: 1.5})  # as if a verify cost 1.5 plain rows
    costs.observe_draft_step = costs.observe_plain = costs.observe_verify = lambda *args: None                 # keep those costs
    llm.executor.speculator.costs = costs
    spec = llm.generate(prompts, params, speculation=Speculation("ngram"))
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    stats = [r.metrics["speculation"] for r in spec]
    assert all(s["drafted"] > 0 for s in stats) and any(s["plain_steps"] > 0 for s in stats)
    llm.close()
