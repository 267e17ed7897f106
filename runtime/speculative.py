"""Speculative decoding as plain functions: draft k tokens, verify them with the target engine in one
call (k + 1 logits), keep the longest accepted prefix plus one token from the target.

Acceptance is the standard rejection-sampling rule (Leviathan et al. 2023; Chen et al. 2023): a
draft token x drawn from q is kept with probability min(1, p(x) / q(x)); on rejection the token is
drawn from norm(max(0, p - q)). The output then follows the target distribution p exactly. Greedy
requests have one-hot p, so the same rule keeps exactly the tokens greedy decoding would produce."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from runtime.params import SamplingParams
from runtime.sampler import draw, probs_after_warping


@dataclass(frozen=True)
class Speculation:
    """Per-request speculation settings.

    method: "ngram" (prompt lookup: copy what followed the latest earlier occurrence of the last
    tokens), "draft" (the engine's draft model; a self-draft int4 build is a draft model too).
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
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"Speculation.method must be 'ngram' or 'draft', got {self.method!r}")
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
    history: list[float] = field(default_factory=list)
    recent_drafted: float = 0.0    # drafted and accepted counts, each verify's weighing DECAY times the one before
    recent_accepted: float = 0.0
    paused: int = 0                # plain decode steps left before drafting is tried again
    pause: int = 0                 # the next pause's length: PROBE_EVERY, doubled after every probe that fails
    plain_steps: int = 0           # steps decoded without drafts because drafting did not pay
    ngrams: NgramIndex | None = None  # prompt lookup's index of this request's tokens

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


PROBE_EVERY = 16  # plain steps between two tries of a request whose drafting did not pay ...
MAX_PAUSE = 256  # ... doubling after every try that fails, up to this many
EMA = 0.2  # weight of a new timing in StepCosts
DECAY = 0.8  # of a request's earlier verifies in its recent acceptance


def _ema(old: float | None, new: float) -> float:
    """The running estimate after observing `new` (the first observation: `new` itself)."""
    return new if old is None else (1 - EMA) * old + EMA * new


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify of k drafts yields when each draft is accepted with this probability: the
    accepted prefix plus the target's own token, (1 - a^(k+1)) / (1 - a)."""
    return k + 1.0 if acceptance >= 1.0 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


@dataclass
class StepCosts:
    """Running estimates (EMA, seconds) of what the executor's calls cost: a plain row's share of a
    batched decode call of n rows (per n: batching makes rows cheaper), a verify call, one draft step,
    one token of a draft catching up on tokens it has not seen, and a step's work outside engine calls.
    On a small model the last is a fifth of a decode step: a step that yields more tokens saves it too."""

    plain_rows: dict[int, float] = field(default_factory=dict)
    verifies: dict[int, float] = field(default_factory=dict)  # per tokens in the call (k + 1)
    draft_step: float | None = None
    draft_prefill: float | None = None  # per token of a draft catch-up over more than two tokens
    acceptance: dict[str, float] = field(default_factory=dict)  # per method, over every request's verifies
    step_overhead: float | None = None  # an executor step's time outside engine calls (scheduling, sampling...)

    def observe_draft_step(self, seconds: float) -> None:
        self.draft_step = _ema(self.draft_step, seconds)

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        self.draft_prefill = _ema(self.draft_prefill, seconds / tokens)

    def observe_plain(self, rows: int, seconds: float) -> None:
        self.plain_rows[rows] = _ema(self.plain_rows.get(rows), seconds / rows)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verifies[tokens] = _ema(self.verifies.get(tokens), seconds)

    def observe_step_overhead(self, seconds: float) -> None:
        self.step_overhead = _ema(self.step_overhead, seconds)

    def observe_acceptance(self, method: str, drafted: int, accepted: int) -> None:
        self.acceptance[method] = _ema(self.acceptance.get(method), accepted / drafted)

    def verify(self, tokens: int) -> float | None:
        """The verify cost for `tokens` (that of the nearest size measured)."""
        if not self.verifies:
            return None
        return self.verifies[min(self.verifies, key=lambda n: (abs(n - tokens), n))]

    def drafting_pays(self, state: SpecState, rows: int = 1) -> bool:
        """In a step decoding `rows` rows: does a verify of k drafts at the recent acceptance a, worth
        E = (1 - a^(k+1)) / (1 - a) tokens, cost less than E plain rows? No plain call of that size
        measured yet: decode plainly (that measures it). No verify measured yet: draft."""
        plain = self.plain_rows.get(rows)
        if plain is None:
            return False
        if not self.verifies:
            return True
        return self._saving(state, plain, rows, state.k, min(state.recent_acceptance, 0.99)) >= 0

    def saving_per_token(self, state: SpecState, rows: int = 1, acceptance: float = 1.0) -> float | None:
        """Seconds per generated token that drafting saves at this acceptance rate and the best draft
        length up to max_draft; <= 0: it does not pay (at acceptance 1: at no acceptance, e.g. a draft
        model as slow per token as the target, or a decode call shared by many rows). None until a
        plain call of `rows` rows and a verify are measured."""
        plain = self.plain_rows.get(rows)
        if plain is None or not self.verifies:
            return None
        return max(self._saving(state, plain, rows, k, acceptance) for k in range(1, state.config.max_draft + 1))

    def _saving(self, state: SpecState, plain: float, rows: int, k: int, acceptance: float) -> float:
        """Seconds per token saved by a verify of k drafts that yields expected_tokens(acceptance, k):
        a plain row costs its share of the decode call, a verify its call and k draft steps, and both
        their share of the step's own work (every step has it, whether its rows draft or not)."""
        share = (self.step_overhead or 0.0) / rows
        drafting = self.verify(k + 1) + k * self._draft_cost(state) + share
        return plain + share - drafting / expected_tokens(acceptance, k)

    def _draft_cost(self, state: SpecState) -> float:
        return (self.draft_step or 0.0) if state.config.method == "draft" else 0.0


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
    slot i mirrors the target's slot i."""

    def __init__(self, target, draft=None):
        self.target, self.draft = target, draft
        self.costs = StepCosts()

    def should_draft(self, seq, rows: int = 1) -> bool:
        """False while drafting is measured to be slower than plain decoding for this request in a
        step of `rows` decode rows: then it decodes plainly for PROBE_EVERY steps and tries one draft
        token again, and after every try that still does not pay it waits twice as long (up to
        MAX_PAUSE). A try costs a verify and the draft's catch-up over the tokens decoded meanwhile, so
        it is skipped (as if it failed) when drafting could not save what that catch-up costs over the
        rest of the request (`_worth_catching_up`); so is a request's first draft, whose catch-up is its
        whole prompt."""
        state = seq.spec
        if not state.config.fallback or (seq.params.seed is not None and not seq.params.greedy):
            return True
        if state.paused > 0:
            state.paused -= 1
            if state.paused == 0:
                if self._worth_catching_up(seq, rows):
                    return True  # the probe: one draft, which measures the acceptance again
                state.paused, state.pause = state.pause, min(2 * state.pause, MAX_PAUSE)
        elif self.costs.drafting_pays(state, rows) and self._worth_catching_up(seq, rows):
            state.pause = PROBE_EVERY
            return True
        elif rows in self.costs.plain_rows:  # measured not to pay (else: this plain step measures it)
            state.paused, state.k = state.pause or PROBE_EVERY, 1  # probes draft one token: cheap, and enough
            state.pause = min(2 * state.paused, MAX_PAUSE)          # to re-measure
        state.plain_steps += 1
        return False

    def _worth_catching_up(self, seq, rows: int) -> bool:
        """Would drafting from here on save more than the draft's catch-up costs? Judged at the better
        of this request's recent acceptance and that of every request's recent verifies with this
        method (1 before any), over the tokens the request may still generate: an upper bound, and
        optimistic (True) while a cost it needs is not measured. Prompt lookup, and a draft that kept
        up, have nothing to catch up: their tries always go ahead (and re-measure the costs)."""
        state = seq.spec
        method = state.config.method
        behind = len(seq.all_ids) - state.draft_cached if method == "draft" else 0
        if behind <= 2 or self.costs.draft_prefill is None:
            return True
        acceptance = max(state.recent_acceptance, self.costs.acceptance.get(method, 1.0))
        saving = self.costs.saving_per_token(state, rows, acceptance)
        if saving is None:
            return True
        left = seq.params.max_new_tokens - len(seq.output_ids)
        return saving > 0 and behind * self.costs.draft_prefill < saving * left

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
        if self.draft is None:
            raise RuntimeError("speculation method 'draft' needs an engine with a draft model "
                               "(build it with a `speculative:` recipe section or pass draft= to LLM)")
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
        start, shapes = time.perf_counter(), self.draft.new_call_shapes
        logits = self.draft.extend(seq.slot, state.draft_cached, new)[-1]
        caught_up, extend_shapes = time.perf_counter(), self.draft.new_call_shapes
        drafts: list[int] = []
        probs: list[np.ndarray] = []
        plain_argmax = seq.params.greedy and seq.params.repetition_penalty == 1.0  # no distributions needed
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
        end, warm = time.perf_counter(), self.draft.new_call_shapes == extend_shapes
        if len(new) > 2:  # long enough that binding a new shape hardly counts
            self.costs.observe_draft_prefill(len(new), caught_up - start)
            if k > 1 and warm:
                self.costs.observe_draft_step((end - caught_up) / (k - 1))
        elif warm and extend_shapes == shapes:  # a call that binds a new shape is not typical: not timed
            self.costs.observe_draft_step((end - start) / k)
        return drafts, None if plain_argmax else probs

    def verify(self, seq, drafts: list[int], draft_probs) -> list[int]:
        """Run [last token] + drafts through the target; returns the tokens to append. The target's
        KV beyond the accepted tokens is garbage that the next call overwrites (rollback = length)."""
        before, start, shapes = len(seq.all_ids), time.perf_counter(), self.target.new_call_shapes
        logits = self.target.extend(seq.slot, seq.num_cached, [seq.all_ids[-1]] + drafts, all_logits=True)
        if self.target.new_call_shapes == shapes:  # a call that binds a new shape is not typical
            self.costs.observe_verify(1 + len(drafts), time.perf_counter() - start)
        tokens = accept(seq.params, logits, drafts, draft_probs, seq.all_ids, seq.rng)
        accepted = len(tokens) - 1
        self.costs.observe_acceptance(seq.spec.config.method, len(drafts), accepted)
        seq.num_cached += 1 + accepted
        seq.spec.record(len(drafts), accepted)
        if self.draft is not None and seq.spec.config.method == "draft":
            seq.spec.draft_cached = min(seq.spec.draft_cached, before + accepted)
        return tokens
