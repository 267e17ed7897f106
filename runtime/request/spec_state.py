"""Per-request speculation: the settings a request asks for (`Speculation`), its running statistics and
draft length (`SpecState`), and its prompt-lookup index (`NgramIndex`). runtime/speculation/speculator.py proposes
and verifies drafts with them; runtime/speculation/draft_policy.py decides from them whether drafting pays."""
from __future__ import annotations

from dataclasses import dataclass


def draft_problem(method: str | None, has_draft: bool) -> str | None:
    """Why speculation `method` cannot run on an engine with (or without) a draft: "draft" needs a draft
    engine. None when it can. LLM, engine-serve and the speculator each raise it as their own error."""
    if method == "draft" and not has_draft:
        return ("speculation method 'draft' needs a draft engine; this engine has none (build one with a "
                "`speculative:` recipe section, load with draft=DIR or serve with --draft DIR, or use 'ngram')")
    return None

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
