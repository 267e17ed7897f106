"""Speculative decoding as plain functions: draft k tokens, verify them with the target engine in one
call (k + 1 logits), keep the longest accepted prefix plus one token from the target.

Acceptance is the standard rejection-sampling rule (Leviathan et al. 2023; Chen et al. 2023): a
draft token x drawn from q is kept with probability min(1, p(x) / q(x)); on rejection the token is
drawn from norm(max(0, p - q)). The output then follows the target distribution p exactly. Greedy
requests have one-hot p, so the same rule keeps exactly the tokens greedy decoding would produce."""
from __future__ import annotations

import numpy as np

from runtime.speculation.draft_policy import StepCosts, decide, timed
from runtime.request.params import SamplingParams
from runtime.request.sampler import draw, probs_after_warping
from runtime.request.spec_state import draft_problem
from runtime.request.spec_state import NgramIndex, SpecState, Speculation, ngram_draft  # noqa: F401  (public here too)


def accept(params: SamplingParams, target_logits: np.ndarray, drafts: list[int], draft_probs: list[np.ndarray] | None,
           history: list[int], rng: np.random.Generator) -> list[int]:
    """Tokens to append: the accepted drafts then one token from the target (correction or bonus).

    target_logits [len(drafts) + 1, vocab]: row i scores the token after history + drafts[:i].
    draft_probs: q for each draft token (None: drafts are deterministic, q is one-hot)."""
    if params.greedy and params.repetition_penalty == 1.0:  # argmax of each row: no distributions needed
        picks = np.argmax(target_logits, axis=-1)
        n = next((i for i, token in enumerate(drafts) if picks[i] != token), len(drafts))
        return list(drafts[:n]) + [int(picks[n])]
    out: list[int] = []
    for i, token in enumerate(drafts):
        p = probs_after_warping(target_logits[i], params, np.asarray(history + out, dtype=np.int64))
        q = _one_hot(token, p.shape[0]) if draft_probs is None else draft_probs[i]
        if params.greedy:
            if int(np.argmax(p)) != token:
                return out + [int(np.argmax(p))]
            out.append(token)
            continue
        if rng.random() < min(1.0, p[token] / max(q[token], 1e-300)):
            out.append(token)
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        return out + [draw(residual / total if total > 0 else p, rng)]
    p = probs_after_warping(target_logits[len(drafts)], params, np.asarray(history + out, dtype=np.int64))
    return out + [int(np.argmax(p)) if params.greedy else draw(p, rng)]


def _one_hot(token: int, size: int) -> np.ndarray:
    q = np.zeros(size, dtype=np.float64)
    q[token] = 1.0
    return q


class Speculator:
    """Proposes drafts for a request and verifies them on the target in one call.

    `draft` is an optional ModelRunner over a smaller engine with the same tokenizer, whose KV
    slot i mirrors the target's slot i. Whether a request drafts at all is runtime/speculation/draft_policy.py's
    decision, on the costs (`self.costs`) this class measures."""

    def __init__(self, target, draft=None):
        self.target, self.draft = target, draft
        self.costs = StepCosts()

    def should_draft(self, seq, rows: int = 1) -> bool:
        """Whether `seq` drafts in a step of `rows` decode rows (draft_policy.decide on the measured
        costs), advancing its back-off in seq.spec: call it once per step and request."""
        return decide(seq, rows, self.costs).apply(seq.spec)

    def budget(self, seq) -> int:
        """Draft tokens that fit the request's remaining output and the KV length."""
        left = seq.params.max_new_tokens - len(seq.output_ids) - 1
        room = self.target.spec.max_seq_len - seq.num_cached - 1
        if self.draft is not None:
            room = min(room, self.draft.spec.max_seq_len - seq.num_cached - 1)
        return max(0, min(seq.spec.k, left, room))

    def propose(self, seq) -> tuple[list[int], list[np.ndarray] | None]:
        k = self.budget(seq)
        if k == 0:
            return [], None
        if seq.spec.config.method == "ngram":
            c = seq.spec.config
            if seq.spec.ngrams is None:
                seq.spec.ngrams = NgramIndex(c.ngram_max)
            return seq.spec.ngrams.draft(seq.all_ids, k, c.ngram_min), None
        if problem := draft_problem(seq.spec.config.method, self.draft is not None):
            raise RuntimeError(problem)
        return self._draft_tokens(seq, k)

    def _draft_tokens(self, seq, k: int) -> tuple[list[int], list[np.ndarray] | None]:
        """k draft tokens: one draft call over the tokens the draft has not seen (1 or 2 after a verify;
        the whole prompt, or everything decoded plainly meanwhile, otherwise), then k - 1 one-token calls.
        A draft step's cost is timed over all of it; a catch-up longer than two tokens is a prefill, timed
        per token on its own (in a draft step's timing it would make drafting look slower than it is).
        Returns the drafts and the distributions they were drawn from (None for greedy requests without a
        repetition penalty: drafting and accepting them need only argmaxes)."""
        ids, state = seq.all_ids, seq.spec
        new = ids[state.draft_cached:]
        with timed(self.draft) as catch_up:
            logits = self.draft.extend(seq.slot, state.draft_cached, new)[-1]
        drafts: list[int] = []
        probs: list[np.ndarray] = []
        plain_argmax = seq.params.greedy and seq.params.repetition_penalty == 1.0  # no distributions needed
        with timed(self.draft) as steps:
            while True:
                if plain_argmax:
                    token = int(np.argmax(logits))
                else:
                    q = probs_after_warping(logits, seq.params, np.asarray(ids + drafts, dtype=np.int64))
                    token = int(np.argmax(q)) if seq.params.greedy else draw(q, seq.rng)
                    probs.append(q)
                drafts.append(token)
                if len(drafts) == k:
                    break
                past = len(ids) + len(drafts) - 1
                logits = self.draft.decode(seq.slot, np.array([token]), np.array([past]))[0]
            state.draft_cached = len(ids) + k - 1
        if len(new) > 2:  # long enough that binding a new shape hardly counts
            self.costs.observe_draft_prefill(len(new), catch_up.seconds)
            if k > 1 and steps.warm:
                self.costs.observe_draft_step(steps.seconds / (k - 1))
        elif steps.warm and catch_up.warm:  # a call that binds a new shape is not typical: not timed
            self.costs.observe_draft_step((catch_up.seconds + steps.seconds) / k)
        return drafts, None if plain_argmax else probs

    def verify(self, seq, drafts: list[int], draft_probs, kv) -> list[int]:
        """Run [last token] + drafts through the target, on `kv` (the KV table's `place(seq)`: the sequence's
        row, or its block table); returns the tokens to append. The KV of the last
        token and the accepted drafts is then cached (the caller reports that to the scheduler); the
        target's KV beyond them is garbage that the next call overwrites (rollback = length)."""
        before = len(seq.all_ids)
        with timed(self.target) as call:
            logits = self.target.extend(kv, seq.num_cached, [seq.all_ids[-1]] + drafts, all_logits=True)
        if call.warm:  # a call that binds a new shape is not typical
            self.costs.observe_verify(1 + len(drafts), call.seconds)
        tokens = accept(seq.params, logits, drafts, draft_probs, seq.all_ids, seq.rng)
        accepted = len(tokens) - 1
        self.costs.observe_acceptance(seq.spec.config.method, len(drafts), accepted)
        seq.spec.record(len(drafts), accepted)
        if self.draft is not None and seq.spec.config.method == "draft":
            seq.spec.draft_cached = min(seq.spec.draft_cached, before + accepted)
        return tokens
