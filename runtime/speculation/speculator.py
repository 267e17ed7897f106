"""Speculative decoding as plain functions: draft k tokens, verify them with the target engine in one
call (k + 1 logits), keep the longest accepted prefix plus one token from the target.

Acceptance is the standard rejection-sampling rule (Leviathan et al. 2023; Chen et al. 2023): a
draft token x drawn from q is kept with probability min(1, p(x) / q(x)); on rejection the token is
drawn from norm(max(0, p - q)). The output then follows the target distribution p exactly. Greedy
requests have one-hot p, so the same rule keeps exactly the tokens greedy decoding would produce.
Exactly up to rounding: the verify call's logits differ from one-token steps' by the call shape's rounding
(more with int8 activations), so after an accepted draft a near-tie can go the other way (docs/ACCURACY.md,
"Quantized speculation"); a greedy verify that accepts nothing emits a one-row step's token.

Per-request speculation lives here too (its one import path): the settings a request asks for (`Speculation`),
its running statistics and draft length (`SpecState`, a sequence's `speculation`), and its prompt-lookup index
(`NgramIndex`); runtime/speculation/draft_policy.py decides from them whether drafting pays."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.speculation.draft_policy import StepCosts, decide, timed
from runtime.speculation.eagle import Features, draft_chain, keep_verified
from runtime.request.params import SamplingParams
from runtime.request.sampler import draw, probs_after_warping



def draft_kind(runner) -> str | None:
    """What drafts for an engine: None (nothing), "model" (a draft engine) or "eagle" (an EAGLE head)."""
    return None if runner is None else getattr(runner, "kind", "model")


def draft_problem(method: str | None, kind: str | None) -> str | None:
    """Why speculation `method` cannot run on an engine whose draft is of `kind` (draft_kind): "draft" needs a
    draft engine, "eagle" an EAGLE head. None when it can. LLM, engine-serve and the speculator each raise it as
    their own error."""
    if method == "draft" and kind != "model":
        return ("speculation method 'draft' needs a draft engine; this engine has "
                f"{'an EAGLE head' if kind else 'none'} (build one with a `speculative:` recipe section, load with "
                "draft=DIR or serve with --draft DIR, or use 'ngram')")
    if method == "eagle" and kind != "eagle":
        return ("speculation method 'eagle' needs an EAGLE draft head; this engine has "
                f"{'a draft model' if kind else 'none'} (train one with engine-compress TARGET --eagle and build it "
                "with `speculative: {draft_model: HEAD_DIR}`, or use 'ngram')")
    return None


METHODS = ("ngram", "draft", "eagle")


@dataclass(frozen=True)
class Speculation:
    """Per-request speculation settings.

    method: "ngram" (prompt lookup: copy what followed the latest earlier occurrence of the last
    tokens), "draft" (the engine's draft model; a self-draft int4 build is a draft model too), "eagle" (the
    engine's EAGLE draft head, runtime/speculation/eagle.py: drafts from the target's own last hidden state).
    num_draft: initial draft length; it adapts to the observed acceptance rate between 1 and max_draft.
    fallback: decode without drafts while the measured costs say drafting is slower than plain
    decoding (low acceptance, or a batch that already shares each decode call among many rows),
    trying a one-token draft again after PROBE_EVERY steps, twice as long after each try that fails
    (up to MAX_PAUSE), and skipping a try (and a request's first draft) whose draft catch-up costs more
    than drafting could save at the best acceptance seen. Not for seeded sampling: its draws
    depend on which steps drafted, and costs are timings, so the output would change from run to run."""

    method: str = "ngram"
    num_draft: int = 4
    max_draft: int = 8
    ngram_max: int = 3
    ngram_min: int = 1
    adaptive: bool = True
    fallback: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"Speculation.method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_draft <= self.max_draft:
            raise ValueError(f"Speculation.num_draft must be in 1..max_draft ({self.max_draft}), got {self.num_draft}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"Speculation.ngram_min/ngram_max must satisfy 1 <= min <= max, got "
                             f"{self.ngram_min}/{self.ngram_max}")


@dataclass
class SpecState:
    """A request's speculation statistics and current draft length."""

    config: Speculation
    k: int = 0
    drafted: int = 0
    accepted: int = 0
    calls: int = 0
    draft_cached: int = 0          # tokens whose KV the draft engine holds for this request
    recent_drafted: float = 0.0    # drafted and accepted counts, each verify's weighing DECAY times the one before
    recent_accepted: float = 0.0
    paused: int = 0                # plain decode steps left before drafting is tried again
    pause: int = 0                 # the next pause's length: PROBE_EVERY, doubled after every probe that fails
    plain_steps: int = 0           # steps decoded without drafts because drafting did not pay
    ngrams: NgramIndex | None = None  # prompt lookup's index of this request's tokens
    features: Features | None = None  # EAGLE: the target's features the head has not read yet (eagle.py)

    def __post_init__(self) -> None:
        self.k = self.config.num_draft

    @property
    def recent_acceptance(self) -> float:
        """Acceptance over the last few verifies, with one accepted and one rejected draft as a prior:
        a couple of early rejections do not make it zero."""
        return (self.recent_accepted + 1) / (self.recent_drafted + 2)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        """Update statistics and adapt k: grow after a fully accepted draft, shrink after a poor one."""
        self.drafted, self.accepted, self.calls = self.drafted + drafted, self.accepted + accepted, self.calls + 1
        self.recent_drafted = DECAY * self.recent_drafted + drafted
        self.recent_accepted = DECAY * self.recent_accepted + accepted
        if not self.config.adaptive or drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k + 1, self.config.max_draft)
        elif accepted < drafted / 2:
            self.k = max(self.k - 1, 1)

    def stats(self) -> dict:
        return {"method": self.config.method, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "verify_calls": self.calls, "draft_len": self.k,
                "plain_steps": self.plain_steps}


DECAY = 0.8  # of a request's earlier verifies in its recent acceptance


class NgramIndex:
    """Prompt lookup for one request without rescanning its tokens every step: for each n-gram
    (n <= ngram_max) of the tokens seen so far, the position just after its latest occurrence. A
    request's tokens only grow (rejected drafts never enter them), so each new token adds ngram_max
    entries."""

    def __init__(self, ngram_max: int):
        self.ngram_max = ngram_max
        self.follows: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `follows`

    def draft(self, tokens: list[int], k: int, ngram_min: int = 1) -> list[int]:
        """The k tokens that followed the latest earlier occurrence of the last n tokens (longest n
        first, down to ngram_min); [] when nothing matches."""
        last = len(tokens) - 1  # n-grams ending here have no continuation yet: not indexed
        for end in range(self.indexed, last):
            for n in range(1, min(self.ngram_max, end + 1) + 1):
                self.follows[tuple(tokens[end - n + 1:end + 1])] = end + 1
        self.indexed = max(self.indexed, last)
        for n in range(min(self.ngram_max, last), ngram_min - 1, -1):
            start = self.follows.get(tuple(tokens[last - n + 1:]))
            if start is not None:  # a continuation that runs into the end repeats with period len - start
                period = tokens[start:start + k]  # (the lookup again on tokens + draft would find just that)
                return (period * k)[:k]
        return []


def ngram_draft(tokens: list[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Prompt lookup over `tokens` from scratch (NgramIndex keeps the index between steps)."""
    return NgramIndex(ngram_max).draft(tokens, k, ngram_min)


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
        self._first_try = None  # the request measuring the first verify (_waits_for_first_verify)

    def should_draft(self, seq, rows: int = 1) -> bool:
        """Whether `seq` drafts in a step of `rows` decode rows (draft_policy.decide on the measured
        costs), advancing its back-off in seq.speculation: call it once per step and request."""
        if seq.speculation.config.method == "eagle" and seq.params.adapter is not None:
            return False  # the head drafts for the base model: a row on a LoRA adapter decodes plainly
        if self._waits_for_first_verify(seq):
            return False
        drafts = decide(seq, rows, self.costs).apply(seq.speculation)
        if drafts and not self.costs.verifies:
            self._first_try = seq
        return drafts

    def _waits_for_first_verify(self, seq) -> bool:
        """Before any verify is measured, one request with a draft engine or head (they always have drafts) tries
        first and measures it (and the method's acceptance); the others decode plainly until then: at batch 8 each
        new request would otherwise try at once, before anything says whether drafting pays."""
        first = self._first_try
        return (not self.costs.verifies and first is not None and first is not seq and not first.finished
                and seq.speculation.config.method in ("draft", "eagle"))

    def budget(self, seq) -> int:
        """Draft tokens that fit the request's remaining output and the KV length."""
        left = seq.params.max_new_tokens - len(seq.output_ids) - 1
        room = self.target.spec.max_seq_len - seq.num_cached - 1
        if self.draft is not None:
            room = min(room, self.draft.spec.max_seq_len - seq.num_cached - 1)
        return max(0, min(seq.speculation.k, left, room))

    def propose(self, seq) -> tuple[list[int], list[np.ndarray] | None]:
        k = self.budget(seq)
        if k == 0:
            return [], None
        if seq.speculation.config.method == "ngram":
            c = seq.speculation.config
            if seq.speculation.ngrams is None:
                seq.speculation.ngrams = NgramIndex(c.ngram_max)
            return seq.speculation.ngrams.draft(seq.all_ids, k, c.ngram_min), None
        if problem := draft_problem(seq.speculation.config.method, draft_kind(self.draft)):
            raise RuntimeError(problem)
        if seq.speculation.config.method == "eagle":
            return draft_chain(self.target, self.draft, seq, k, self.costs, timed)
        return self._draft_tokens(seq, k)

    def _draft_tokens(self, seq, k: int) -> tuple[list[int], list[np.ndarray] | None]:
        """k draft tokens: one draft call over the tokens the draft has not seen (1 or 2 after a verify;
        the whole prompt, or everything decoded plainly meanwhile, otherwise), then k - 1 one-token calls.
        A draft step's cost is timed over all of it; a catch-up longer than two tokens is a prefill, timed
        per token on its own (in a draft step's timing it would make drafting look slower than it is).
        Returns the drafts and the distributions they were drawn from (None for greedy requests without a
        repetition penalty: drafting and accepting them need only argmaxes)."""
        ids, state = seq.all_ids, seq.speculation
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
        target's KV beyond them is garbage that the next call overwrites (rollback = length).
        A greedy request that keeps none of its drafts takes its token (and the last token's KV) from a one-row
        call, the shape of a plain step at batch 1: the verify call rounds differently (docs/ACCURACY.md,
        "Quantized speculation"), and at a near-tie its first row could pick another token, so a request whose
        drafts never match would change its text. That costs a one-row call after each verify that keeps none."""
        before = len(seq.all_ids)
        pool = self.target.lora
        if pool is not None:  # the target verifies with the sequence's adapter (a draft model has none)
            pool.assign(kv, seq.params.adapter)
        eagle = seq.speculation.config.method == "eagle"
        with timed(self.target) as call:  # the verify and, after one that keeps nothing, its one-row call
            out = self.target.extend(kv, seq.num_cached, [seq.all_ids[-1]] + drafts, all_logits=True, features=eagle)
            logits, hidden = out if eagle else (out, None)  # an EAGLE row's verify returns the target's features
            tokens = accept(seq.params, logits, drafts, draft_probs, seq.all_ids, seq.rng)
            accepted = len(tokens) - 1
            if accepted == 0 and seq.params.greedy:  # the token of a one-row step, as plain decoding picks it
                step = self.target.extend(kv, seq.num_cached, [seq.all_ids[-1]])
                tokens = accept(seq.params, step, [], None, seq.all_ids, seq.rng)
        # a verify's cost counts the one-row calls that follow those keeping nothing (at an acceptance of 0.2,
        # four verifies in five for one draft); a call that binds a new shape is not typical, unless no verify is
        # measured yet: each row's first verify of each length binds one (at batch 8, dozens), and until one is
        # measured every request would draft
        if call.warm or not self.costs.verifies:
            self.costs.observe_verify(1 + len(drafts), call.seconds)
        self.costs.observe_acceptance(seq.speculation.config.method, len(drafts), accepted)
        seq.speculation.record(len(drafts), accepted)
        if eagle:
            keep_verified(seq, hidden, accepted)
        if self.draft is not None and seq.speculation.config.method == "draft":
            seq.speculation.draft_cached = min(seq.speculation.draft_cached, before + accepted)
        return tokens
