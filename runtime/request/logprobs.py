"""Per-token log-probabilities for the rows that ask for them (SamplingParams.logprobs / prompt_logprobs).

A generated token's logprob is the log-softmax of the logits it was sampled from after the repetition
penalty and the temperature (a greedy row: after the penalty, unscaled), before top-k / top-p truncation, so
every candidate keeps a finite value; with the defaults (no penalty, temperature 0 or 1) it is the model's
own log-probability. A prompt token's logprob is the log-softmax of the raw logits at the position before it
(the prompt is not sampled); the first prompt token has none. Computed as logit - logsumexp (exp in float32,
summed in float64) for the token and its alternatives alone, from the engine's full logits, only for the rows that ask: the executor reads full logits for them (runtime/batching/decode.py,
head_for) and every other row keeps the sampling head's fast path."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.request.params import SamplingParams
from runtime.request.sampler import apply_repetition_penalty


NEAR = 8.0  # logits this far below the maximum (probability ratio e^-8) are searched first for the top ids


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability and the `top` most likely ids with theirs, most likely first (ties: lower id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logsumexp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) over the last axis: exp in float32 (the logits' own precision), summed in float64."""
    m = x.max(axis=-1, keepdims=True)
    return m[..., 0].astype(np.float64) + np.log(np.exp(x - m).sum(axis=-1, dtype=np.float64))


def score(logits: np.ndarray, token: int, top: int, lse: float | None = None) -> TokenLogprob:
    """`token`'s log-softmax entry of a logits row [vocab] and its `top` best entries (only those entries are
    computed: logit - logsumexp; the row's order is the log-softmax's)."""
    lse = float(logsumexp(logits)) if lse is None else lse
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = _top(logits, top)
        best = tuple((int(i), float(logits[i]) - lse) for i in ids)
    return TokenLogprob(int(token), float(logits[token]) - lse, best)


def _top(logits: np.ndarray, top: int) -> np.ndarray:
    """The ids of the `top` largest logits, largest first (ties: lower id). Exact: the candidates within NEAR
    of the maximum are searched first (a few dozen in a peaked row instead of the whole vocabulary); only
    when they are fewer than `top` is the whole row."""
    near = np.flatnonzero(logits >= logits.max() - NEAR)
    pool = near if len(near) >= top else np.arange(logits.shape[-1])
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
        rows = np.asarray(logits[:end - start], dtype=np.float32)
        lse = logsumexp(rows)
        for j in range(end - start):
            self.prompt[start + j + 1] = score(rows[j], prompt_ids[start + j + 1], self.params.prompt_logprobs, float(lse[j]))
