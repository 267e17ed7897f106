"""When drafting pays: the cost model (running estimates of what the executor's calls cost), the per-step
drafting decision with its back-off, and the one place that times engine calls for that model.

runtime/speculation/speculator.py proposes, verifies and accepts drafts; this file only decides whether a request
drafts this step. `decide` is a pure function of a request's state and the measured costs; the
back-off it implies is written to the request by `Decision.apply`, nowhere else."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

PROBE_EVERY = 16  # plain steps between two tries of a request whose drafting did not pay ...
MAX_PAUSE = 256  # ... doubling after every try that fails, up to this many
EMA = 0.2  # weight of a new timing in StepCosts


def judged_acceptance(state, costs: StepCosts) -> float:
    """The acceptance a request's drafting is judged at: that of its own recent verifies, or before it has any, the
    method's measured over every request's verifies (the prior's 0.5 only before any request of the method verified:
    a new request of a method that does not pay at this load does not try it)."""
    if not state.recent_drafted and state.config.method in costs.acceptance:
        return costs.acceptance[state.config.method]
    return state.recent_acceptance


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
    refeed: float | None = None  # EAGLE: per token of the target run again for features no call returned
    acceptance: dict[str, float] = field(default_factory=dict)  # per method, over every request's verifies
    step_overhead: float | None = None  # an executor step's time outside engine calls (scheduling, sampling...)

    def observe_draft_step(self, seconds: float) -> None:
        self.draft_step = _ema(self.draft_step, seconds)

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        self.draft_prefill = _ema(self.draft_prefill, seconds / tokens)

    def observe_refeed(self, tokens: int, seconds: float) -> None:
        self.refeed = _ema(self.refeed, seconds / tokens)

    def observe_plain(self, rows: int, seconds: float) -> None:
        self.plain_rows[rows] = _ema(self.plain_rows.get(rows), seconds / rows)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verifies[tokens] = _ema(self.verifies.get(tokens), seconds)

    def observe_step_overhead(self, seconds: float) -> None:
        self.step_overhead = _ema(self.step_overhead, seconds)

    def observe_acceptance(self, method: str, drafted: int, accepted: int) -> None:
        self.acceptance[method] = _ema(self.acceptance.get(method), accepted / drafted)

    def plain_row(self, rows: int) -> float | None:
        """A plain row's share of a decode call of `rows` rows (that of the nearest row count measured: a probe in
        a step of a row count not seen yet is judged by its neighbours', not let through unjudged)."""
        if not self.plain_rows:
            return None
        return self.plain_rows[min(self.plain_rows, key=lambda n: (abs(n - rows), -n))]

    def verify(self, tokens: int) -> float | None:
        """The verify cost for `tokens` (that of the nearest size measured)."""
        if not self.verifies:
            return None
        return self.verifies[min(self.verifies, key=lambda n: (abs(n - tokens), n))]

    def drafting_pays(self, state, rows: int = 1) -> bool:
        """In a step decoding `rows` rows: does a verify of k drafts at the recent acceptance a, worth
        E = (1 - a^(k+1)) / (1 - a) tokens, cost less than E plain rows? No plain call of that size
        measured yet: decode plainly (that measures it). No verify measured yet: draft."""
        plain = self.plain_rows.get(rows)
        if plain is None:
            return False
        if not self.verifies:
            return True
        return self._saving(state, plain, rows, state.k, min(judged_acceptance(state, self), 0.99)) >= 0

    def saving_per_token(self, state, rows: int = 1, acceptance: float = 1.0) -> float | None:
        """Seconds per generated token that drafting saves at this acceptance rate and the best draft
        length up to max_draft; <= 0: it does not pay (at acceptance 1: at no acceptance, e.g. a draft
        model as slow per token as the target, or a decode call shared by many rows). None until a
        plain call (of `rows` rows, else the nearest count measured) and a verify are measured."""
        plain = self.plain_row(rows)
        if plain is None or not self.verifies:
            return None
        return max(self._saving(state, plain, rows, k, acceptance) for k in range(1, state.config.max_draft + 1))

    def _saving(self, state, plain: float, rows: int, k: int, acceptance: float) -> float:
        """Seconds per token saved by a verify of k drafts that yields expected_tokens(acceptance, k):
        a plain row costs its share of the decode call, a verify its call and k draft steps, and both
        their share of the step's own work (every step has it, whether its rows draft or not)."""
        share = (self.step_overhead or 0.0) / rows
        drafting = self.verify(k + 1) + k * self._draft_cost(state) + share
        return plain + share - drafting / expected_tokens(acceptance, k)

    def _draft_cost(self, state) -> float:
        return (self.draft_step or 0.0) if state.config.method in ("draft", "eagle") else 0.0


@dataclass
class CallTiming:
    """One timed span of engine calls: seconds, and whether it is typical (`warm`: no call in it bound a
    new input shape; a call that does is slower than the next of its shape, so it is not timed)."""

    seconds: float = 0.0
    warm: bool = True


@contextmanager
def timed(runner) -> Iterator[CallTiming]:
    """Time the calls made on `runner` inside the block: `with timed(runner) as t: ...`, then read
    t.seconds and t.warm. The one place that times calls for StepCosts (executor, verify, draft)."""
    timing, start, shapes = CallTiming(), time.perf_counter(), runner.new_call_shapes
    yield timing
    timing.seconds, timing.warm = time.perf_counter() - start, runner.new_call_shapes == shapes


@dataclass(frozen=True)
class Decision:
    """Whether a request drafts this step, and its back-off afterwards (SpecState's fields of that name)."""

    draft: bool
    paused: int
    pause: int
    k: int
    plain_steps: int

    def apply(self, state) -> bool:
        """Write the back-off into the request's state; returns `draft`."""
        state.paused, state.pause, state.k, state.plain_steps = self.paused, self.pause, self.k, self.plain_steps
        return self.draft


def decide(seq, rows: int, costs: StepCosts) -> Decision:
    """Drafting this step for a request in a step of `rows` decode rows, or not, while drafting is
    measured to be slower than plain decoding: then it decodes plainly for PROBE_EVERY steps and tries
    one draft token again, and after every try that still does not pay it waits twice as long (up to
    MAX_PAUSE). A try costs a verify and the draft's catch-up over the tokens decoded meanwhile, so it
    is skipped (as if it failed) when drafting could not save what that catch-up costs over the rest of
    the request (`worth_catching_up`); so is a request's first draft, whose catch-up is its whole
    prompt. Reads seq and costs only; `Decision.apply` writes the back-off."""
    state = seq.speculation
    paused, pause, k, plain_steps = state.paused, state.pause, state.k, state.plain_steps
    if not state.config.fallback or (seq.params.seed is not None and not seq.params.greedy):
        return Decision(True, paused, pause, k, plain_steps)
    if paused > 0:
        paused -= 1
        if paused == 0:
            if worth_catching_up(seq, rows, costs):
                return Decision(True, paused, pause, k, plain_steps)  # the probe: one draft, which re-measures
            paused, pause = pause, min(2 * pause, MAX_PAUSE)
    elif costs.drafting_pays(state, rows) and worth_catching_up(seq, rows, costs):
        return Decision(True, paused, PROBE_EVERY, k, plain_steps)
    elif rows in costs.plain_rows:  # measured not to pay (else: this plain step measures it)
        paused, k = pause or PROBE_EVERY, 1  # probes draft one token: cheap, and enough to re-measure
        pause = min(2 * paused, MAX_PAUSE)
    return Decision(False, paused, pause, k, plain_steps + 1)


def worth_catching_up(seq, rows: int, costs: StepCosts) -> bool:
    """Would drafting from here on save more than the draft's catch-up costs? Judged at the better
    of this request's recent acceptance (its prior's 0.5 before a verify of its own) and that of every request's
    recent verifies with this method (1 before any), over the tokens the request may still generate: an upper
    bound, and optimistic (True) while a cost it needs is not measured, so a probe after a pause re-measures a
    method whose estimate is low (a request's first try is judged by that estimate: `judged_acceptance`). A try
    that could save nothing at that acceptance (a decode call shared by many rows) does not go ahead, whatever
    its catch-up.
    Prompt lookup, and a draft that kept up, have nothing to catch up; an EAGLE head catches up on the features
    its row's calls returned (cheap: one layer), and runs the target again only where none did (eagle.behind)."""
    state = seq.speculation
    method = state.config.method
    acceptance = max(state.recent_acceptance, costs.acceptance.get(method, 1.0))
    saving = costs.saving_per_token(state, rows, acceptance)
    if saving is None:
        return True
    cost = catch_up_cost(seq, costs)
    left = seq.params.max_new_tokens - len(seq.output_ids)
    return saving > 0 and (cost is None or cost < saving * left)


def catch_up_cost(seq, costs: StepCosts) -> float | None:
    """Seconds the draft's catch-up before `seq`'s next draft costs (None: not measured; 0: nothing to catch up)."""
    from runtime.speculation.eagle import behind

    method = seq.speculation.config.method
    if method == "draft":
        pairs, rerun = len(seq.all_ids) - seq.speculation.draft_cached, 0
    elif method == "eagle":
        pairs, rerun = behind(seq)
    else:
        return 0.0
    if pairs <= 2:
        return 0.0
    if costs.draft_prefill is None or rerun > 2 and costs.refeed is None:
        return None
    return pairs * costs.draft_prefill + (rerun * costs.refeed if rerun > 2 else 0.0)
