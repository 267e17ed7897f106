"""Per-token log-probabilities for the rows that ask for them (SamplingParams.logprobs / prompt_logprobs).

A generated token's logprob is the log-softmax of the logits it was sampled from after the repetition
penalty and the temperature (a greedy row: after the penalty, unscaled), before top-k / top-p truncation, so
every candidate keeps a finite value; with the defaults (no penalty, temperature 0 or 1) it is the model's
own log-probability. A prompt token's logprob is the log-softmax of the raw logits at the position before it
(the prompt is not sampled); the first prompt token has none. Computed as logit - logsumexp (exp in float32,
summed in float64) for the token and its alternatives alone, from the engine's full logits, only for the rows that ask: the executor reads full logits for them (runtime/batching/decode.py,
head_for) and every other row keeps the sampling head's fast path."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime.request.params import SamplingParams
from runtime.request.sampler import apply_repetition_penalty


NEAR_RATIO = np.float32(np.exp(-8.0))  # ids within e^-8 of the most likely one are searched first for the top ids


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability and the `top` most likely ids with theirs, most likely first (ties: lower id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def score(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s log-softmax entry of a logits row [vocab] and its `top` best entries (only those entries are
    computed: logit - logsumexp, exp in float32, the logits' own precision, summed in float64; the row's order
    is the log-softmax's). Three passes over the vocabulary: max, exp, sum (+ one for the top candidates)."""
    logits = np.asarray(logits, dtype=np.float32)
    m = logits.max()
    e = logits - m
    np.exp(e, out=e)  # [vocab] in place: one temporary row (a row stays in cache; a batch's [n, vocab] does not)
    lse = float(m) + float(np.log(e.sum(dtype=np.float64)))
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = _top(logits, top, np.flatnonzero(e >= NEAR_RATIO))
        best = tuple((int(i), float(logits[i]) - lse) for i in ids)
    return TokenLogprob(int(token), float(logits[token]) - lse, best)


def score_rows(rows: np.ndarray, tokens: Sequence[int], tops: Sequence[int]) -> list[TokenLogprob]:
    """score() of each row of [n, vocab] against its token, with its number of top entries."""
    return [score(row, token, top) for row, token, top in zip(rows, tokens, tops)]


def _top(logits: np.ndarray, top: int, near: np.ndarray) -> np.ndarray:
    """The ids of the `top` largest logits, largest first (ties: lower id). Exact: the candidates `near` (those
    whose exp(logit - max) >= NEAR_RATIO, ascending: every id above any id left out, exp being monotonic) are
    searched first, a few dozen in a typical row instead of the whole vocabulary; a row so peaked that they
    are fewer than `top` takes every id at or above its top-th value (one partition of the row)."""
    if len(near) < top:
        near = np.flatnonzero(logits >= np.partition(logits, -top)[-top])
    pool = near
    if top < len(pool):  # every id tied with the top-th value stays a candidate: the lower ids win the ties
        kth = np.partition(logits[pool], -top)[-top]
        pool = pool[logits[pool] >= kth]
    return pool[np.lexsort((pool, -logits[pool]))][:top]


def sampled_logits(logits_row: np.ndarray, params: SamplingParams, history) -> np.ndarray:
    """The logits a token is drawn from before truncation: penalty, then temperature (as runtime/request/sampler.py)."""
    x = apply_repetition_penalty(np.asarray(logits_row, dtype=np.float32), history, params.repetition_penalty)
    if params.temperature not in (0.0, 1.0):
        x = x / np.float32(params.temperature)
    return x


class Scores:
    """A sequence's logprobs: `generated` (one per output token, in order) and `prompt` (one per prompt
    position, None for the first; filled as prompt chunks run, again after a preemption without harm)."""

    def __init__(self, params: SamplingParams, prompt_len: int):
        self.params = params
        self.generated: list[TokenLogprob] = []
        self.prompt: list[TokenLogprob | None] | None = [None] * prompt_len if params.prompt_logprobs is not None else None

    def add(self, logits_row: np.ndarray, seq, token: int) -> None:
        """The logprob of a token just sampled from `logits_row` for `seq` (a Sequence: its ids before the token
        are the penalty's history)."""
        if self.params.logprobs is not None:
            history = seq.history() if self.params.repetition_penalty != 1.0 else None
            self.generated.append(score(sampled_logits(logits_row, self.params, history), token, self.params.logprobs))

    def results(self, generated: int) -> tuple[list | None, list | None]:
        """(the first `generated` tokens' entries, the prompt's), each None where not asked for (a stop string
        drops the tokens accepted after it: their entries go too)."""
        return (self.generated[:generated] if self.params.logprobs is not None else None), self.prompt

    def add_prompt(self, logits: np.ndarray, start: int, prompt_ids: list[int]) -> None:
        """Prompt logits of positions start.. [n, vocab]: row j scores prompt token start + j + 1."""
        if self.prompt is None:
            return
        end = min(start + len(logits), len(prompt_ids) - 1)  # the last row predicts a generated token
        if end <= start:
            return
        ids = prompt_ids[start + 1:end + 1]
        self.prompt[start + 1:end + 1] = score_rows(logits[:end - start], ids, [self.params.prompt_logprobs] * len(ids))

