"""EAGLE's features and the pay-or-fall-back policy with fake costs (fast): the features the target's calls return
are kept per sequence and only the positions no call returned are run again; a request's first try is judged by
the method's measured acceptance, so at batch 8 a head that does not pay is not tried by every new request.

The costs are the README Q4_1 engine's order of magnitude (docs/BENCHMARKS.md, EAGLE): a one-row step 9.7 ms, a
batch-8 step 37 ms (4.6 ms a row), a head step 1 ms."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.request.params import SamplingParams
from runtime.speculation.draft_policy import StepCosts, catch_up_cost, judged_acceptance
from runtime.speculation.eagle import Features, _features_for, behind, keep_features
from runtime.speculation.speculator import Speculation, Speculator, SpecState

HIDDEN = 4


class _Seq:
    def __init__(self, spec: Speculation, prompt: int = 100, output: int = 0, max_new: int = 128):
        self.speculation, self.params = SpecState(spec), SamplingParams(max_new_tokens=max_new)
        self.all_ids = list(range(prompt + output))
        self.output_ids = self.all_ids[prompt:]
        self.slot, self.rng, self.finished = 0, None, False


def _costs(acceptance: float | None) -> StepCosts:
    costs = StepCosts(plain_rows={1: 0.0097, 8: 0.0046}, verifies={n: 0.0097 + 0.0012 * (n - 1) for n in range(2, 10)},
                      draft_step=0.001, draft_prefill=0.0002, refeed=0.002)
    if acceptance is not None:
        costs.acceptance["eagle"] = acceptance
    return costs


def _features(start: int, end: int) -> np.ndarray:
    """Features whose first column is their position (to check which positions were returned)."""
    out = np.zeros((end - start, HIDDEN), np.float32)
    out[:, 0] = np.arange(start, end)
    return out


def test_a_new_request_is_judged_by_the_methods_measured_acceptance():
    """No verify of its own: the method's acceptance over every request's verifies judges its first try, not the
    prior's 0.5. At batch 8 a head accepted 14% of the time never pays (a verify of one row costs two rows' share
    of the batched call): none of 128 steps drafts. At batch 1 a head accepted 90% of the time drafts at once."""
    speculator = Speculator(target=None)
    speculator.costs = costs = _costs(0.14)
    fresh = _Seq(Speculation("eagle"))
    assert judged_acceptance(fresh.speculation, costs) == 0.14 and fresh.speculation.recent_acceptance == 0.5
    assert not any(speculator.should_draft(fresh, rows=8) for _ in range(128))
    assert fresh.speculation.plain_steps == 128
    costs.acceptance["eagle"] = 0.9
    assert speculator.should_draft(_Seq(Speculation("eagle")), rows=1)
    speculator.costs = _costs(None)  # no request of the method verified yet: the prior's 0.5 judges (it pays alone)
    assert speculator.should_draft(_Seq(Speculation("eagle")), rows=1)


def test_a_low_estimate_is_re_measured_by_the_probes_of_requests_that_never_tried():
    """One unlucky first verify (0 of 4) makes the method's estimate 0: new requests do not try at once, but their
    first probe (one draft, judged at their prior) goes ahead where one draft could pay (batch 1), so the estimate
    is not stuck; at batch 8 even the prior does not pay and the probe is skipped."""
    speculator = Speculator(target=None)
    speculator.costs = _costs(0.0)
    for rows, expected in ((1, [False] * 16 + [True]), (8, [False] * 17)):
        seq = _Seq(Speculation("eagle"))
        keep_features(seq.speculation, 0, _features(0, 99))  # its prompt's features: nothing to run again
        assert [speculator.should_draft(seq, rows=rows) for _ in range(17)] == expected
        assert seq.speculation.k == 1


def test_before_any_verify_is_measured_one_request_tries_first():
    """Eight new requests in the first step of a fresh engine: one tries (and measures a verify and the method's
    acceptance), the others decode plainly until then, and are judged by what it measured."""
    speculator = Speculator(target=None)
    speculator.costs = StepCosts(plain_rows={8: 0.0046})
    batch = [_Seq(Speculation("eagle")) for _ in range(8)]
    assert [speculator.should_draft(seq, rows=8) for seq in batch] == [True] + [False] * 7
    assert [speculator.should_draft(seq, rows=8) for seq in batch] == [True] + [False] * 7  # until it verified
    speculator.costs.observe_verify(5, 0.014)  # its verify: 4 drafts, none accepted
    speculator.costs.observe_acceptance("eagle", 4, 0)
    batch[0].speculation.record(4, 0)
    assert not any(speculator.should_draft(seq, rows=8) for seq in batch[1:] for _ in range(64))
    other = Speculator(target=None)
    other.costs = StepCosts(plain_rows={8: 0.0046})
    first, second = _Seq(Speculation("eagle")), _Seq(Speculation("eagle"))
    assert other.should_draft(first, rows=8) and not other.should_draft(second, rows=8)
    first.finished = True  # it ended before its verify: the next request tries
    assert other.should_draft(second, rows=8)


def test_a_request_with_verifies_of_its_own_is_judged_by_them():
    costs = _costs(0.14)
    seq = _Seq(Speculation("eagle"))
    for _ in range(10):
        seq.speculation.record(4, 4)
    assert judged_acceptance(seq.speculation, costs) == seq.speculation.recent_acceptance > 0.9
    assert costs.drafting_pays(seq.speculation, rows=1)


def test_the_probes_of_a_head_that_does_not_pay_at_batch_8_are_skipped():
    """A request that tried and failed probes one draft after a pause; the probe is judged at the better of its own
    and the method's acceptance and skipped (as if it failed) while drafting could save nothing at this load."""
    speculator = Speculator(target=None)
    speculator.costs = _costs(0.14)
    seq = _Seq(Speculation("eagle"), max_new=2000)
    seq.speculation.record(4, 0)
    seq.speculation.record(1, 0)
    decisions = [speculator.should_draft(seq, rows=8) for _ in range(1000)]
    assert not any(decisions)
    assert not any(speculator.should_draft(seq, rows=1) for _ in range(600))  # 0.14 does not pay alone either
    speculator.costs.acceptance["eagle"] = 0.8  # other requests' drafts are accepted: this one's probe goes ahead
    assert any(speculator.should_draft(seq, rows=1) for _ in range(600))


def test_the_catch_up_counts_a_target_rerun_only_where_no_call_returned_features():
    costs = _costs(0.5)
    seq = _Seq(Speculation("eagle"), prompt=200)
    keep_features(seq.speculation, 0, _features(0, 199))  # the prompt chunk's features (its last token's pending)
    assert behind(seq) == (199, 0)
    assert catch_up_cost(seq, costs) == pytest.approx(199 * 0.0002)
    reused = _Seq(Speculation("eagle"), prompt=200)
    keep_features(reused.speculation, 64, _features(64, 199))  # a reused 64-token prefix: no call computed it
    assert behind(reused) == (199, 64)
    assert catch_up_cost(reused, costs) == pytest.approx(199 * 0.0002 + 64 * 0.002)
    costs.refeed = None
    assert catch_up_cost(reused, costs) is None  # not measured: optimistic
    assert catch_up_cost(_Seq(Speculation("ngram")), costs) == 0.0


def test_features_are_appended_trimmed_where_recomputed_and_replaced_after_a_gap():
    state = SpecState(Speculation("eagle"))
    keep_features(state, 0, _features(0, 10))
    keep_features(state, 10, _features(10, 11))  # a plain step
    keep_features(state, 11, _features(11, 14))  # a verify's accepted tokens
    assert (state.features.start, state.features.end) == (0, 14)
    np.testing.assert_array_equal(state.features.between(0, 14)[:, 0], np.arange(14))
    keep_features(state, 5, _features(5, 20) + 0.5)  # recomputed from 5 (after a preemption): the newer ones count
    assert (state.features.start, state.features.end) == (0, 20)
    np.testing.assert_array_equal(state.features.between(3, 7)[:, 0], [3, 4, 5.5, 6.5])
    keep_features(state, 30, _features(30, 31))  # a gap: held anew from there
    assert (state.features.start, state.features.end) == (30, 31)


class _Target:
    """Records what the catch-up runs the target over; returns position-stamped features."""

    hidden_size = HIDDEN

    def __init__(self):
        self.calls = []

    def extend(self, slot, past_len, tokens, all_logits=False, head="logits", features=False):
        self.calls.append((past_len, len(tokens), all_logits, features))
        return np.zeros((1, 8), np.float32), _features(past_len, past_len + len(tokens))


@pytest.mark.parametrize("held", [(0, 50), (20, 50), (0, 30), (20, 30), None])
def test_the_head_reads_held_features_and_the_target_runs_only_over_the_others(held):
    seq = _Seq(Speculation("eagle"), prompt=51)  # the newest token at position 50: features wanted for [0, 50)
    if held is not None:
        keep_features(seq.speculation, held[0], _features(*held))
    target = _Target()
    features, rerun = _features_for(target, seq, 0, 50)
    np.testing.assert_array_equal(features[:, 0], np.arange(50))
    ran = [(past, n) for past, n, _, _ in target.calls]
    lo, hi = held or (50, 50)
    assert ran == [(a, b - a) for a, b in ((0, lo), (hi, 50)) if b > a] and rerun == sum(n for _, n in ran)
    assert all(not every and wanted for _, _, every, wanted in target.calls)  # features only, the last logits
    assert isinstance(seq.speculation.features, Features) or held is None
