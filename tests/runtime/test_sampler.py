"""runtime.request.sampler against transformers' logits processors; runtime.request.params validation."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from runtime.request.params import SamplingParams
from runtime.request.sampler import (apply_repetition_penalty, draw, make_rng, probs_after_warping,
                             sample, warp_logits)

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 1000

COMBOS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.8, repetition_penalty=1.2),
    SamplingParams(temperature=0.5, top_k=5, top_p=0.95, repetition_penalty=0.8),
    SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.5),
    SamplingParams(temperature=2.0, top_k=VOCAB + 10),
    SamplingParams(temperature=0.9, top_k=1),
    SamplingParams(temperature=1.1, top_p=1e-4),
    SamplingParams(temperature=1.0, repetition_penalty=2.0),
]


def hf_probs(logits: np.ndarray, history: np.ndarray, p: SamplingParams) -> np.ndarray:
    """transformers' processors in generate()'s order, then softmax in float64. [vocab]"""
    procs = lp.LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(lp.RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.temperature != 1.0:
        procs.append(lp.TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        procs.append(lp.TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(lp.TopPLogitsWarper(p.top_p))
    scores = procs(torch.from_numpy(history[None]), torch.from_numpy(logits[None].copy()))
    return torch.softmax(scores.double(), dim=-1)[0].numpy()


def random_case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(VOCAB) * 3.0).astype(np.float32)  # [vocab]
    history = rng.integers(0, VOCAB, size=40).astype(np.int64)
    history = np.concatenate([history, history[:5], [VOCAB + 3]])  # repeats + an id outside the vocab
    return logits, history


@pytest.mark.parametrize("params", COMBOS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-r{p.repetition_penalty}")
def test_warping_matches_transformers(params: SamplingParams) -> None:
    for seed in range(8):
        logits, history = random_case(seed)
        ours = probs_after_warping(logits, params, history)
        ref = hf_probs(logits, history, params)
        np.testing.assert_array_equal(np.flatnonzero(ours > 0), np.flatnonzero(ref > 0))
        np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=0)
        assert ours.dtype == np.float64 and abs(ours.sum() - 1.0) < 1e-9


def test_repetition_penalty_matches_transformers() -> None:
    logits, history = random_case(42)
    for penalty in (0.5, 1.0, 1.3):
        ref = lp.RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(history[None]),
                                                           torch.from_numpy(logits[None].copy()))
        np.testing.assert_array_equal(apply_repetition_penalty(logits, history, penalty), ref[0].numpy())
    assert np.array_equal(apply_repetition_penalty(logits, [], 1.5), logits)


def test_top_k_keeps_ties() -> None:
    logits = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 0.5], dtype=np.float32)
    kept = np.isfinite(warp_logits(logits, SamplingParams(temperature=1.0, top_k=3), None))
    assert kept.tolist() == [False, True, True, True, True, False]


def test_greedy_is_first_argmax() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50)).astype(np.float32)  # [batch, vocab]
    logits[2, [7, 31]] = 10.0  # tie: the first index wins, like torch.argmax
    params = [SamplingParams()] * 6
    out = sample(logits, params, [None] * 6, [None] * 6)
    assert out.dtype == np.int64 and out.shape == (6,)
    np.testing.assert_array_equal(out, np.argmax(logits, axis=-1))
    assert out[2] == 7 == int(torch.argmax(torch.from_numpy(logits[2])))
    onehot = probs_after_warping(logits[2], SamplingParams(), None)
    assert onehot[7] == 1.0 and onehot.sum() == 1.0


def test_greedy_applies_repetition_penalty() -> None:
    logits, history = random_case(3)
    p = SamplingParams(repetition_penalty=5.0)
    top = int(np.argmax(logits))
    history = np.append(history, top)
    ref = lp.RepetitionPenaltyLogitsProcessor(5.0)(torch.from_numpy(history[None]), torch.from_numpy(logits[None].copy()))
    got = sample(logits[None], [p], [history], [None])
    assert got[0] == int(torch.argmax(ref[0])) != top


def test_seeded_sampling_reproducible() -> None:
    logits, history = random_case(7)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(seed: int | None) -> list[int]:
        rng = make_rng(seed)
        return [int(sample(logits[None], [p], [history], [rng])[0]) for _ in range(64)]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_mixed_batch_uses_row_params_and_rngs() -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 20)).astype(np.float32)  # [batch, vocab]
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, seed=9)]
    out = sample(logits, params, [None, None, None], [None, make_rng(1), make_rng(9)])
    assert out[0] == np.argmax(logits[0]) and out[1] == np.argmax(logits[1])
    assert out[2] == draw(probs_after_warping(logits[2], params[2]), make_rng(9))
    with pytest.raises(ValueError, match="rng"):
        sample(logits, params, [None] * 3, [None] * 3)


def test_empirical_frequencies_match_distribution() -> None:
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)  # [vocab]
    p = SamplingParams(temperature=0.9, top_k=6, top_p=0.97, repetition_penalty=1.3)
    history = np.array([0, 3], dtype=np.int64)
    probs = probs_after_warping(logits, p, history)
    n = 20000
    out = sample(np.broadcast_to(logits, (n, 8)), [p] * n, [history] * n, [make_rng(0)] * n)
    counts = np.bincount(out, minlength=8)
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = probs[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (chi2, counts, expected)  # df <= 5; p(chi2 > 30) < 2e-5


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("inf")), ("temperature", float("nan")),
    ("top_k", -1), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("max_new_tokens", 0),
    ("stop", ("ok", "")), ("seed", -3),
])
def test_params_errors_name_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert field in msg and repr(value) in msg and "must be" in msg


def test_params_defaults_and_stop_list() -> None:
    p = SamplingParams(stop=["###", "\n\n"])
    assert p.stop == ("###", "\n\n") and p.greedy and p.top_k == 0 and p.max_new_tokens == 64
    assert SamplingParams(stop="END").stop == ("END",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
