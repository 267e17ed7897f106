"""Iteration-level scheduling: every step decodes one token for each running sequence and spends
what is left of the token budget on prompt chunks, admitting waiting sequences first come first
served into free KV slots. The scheduler owns sequence state: slots and progress go through its slot
table (runtime/batching/slot_table.py), and whoever computes tokens reports them with `advance`."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtime.model.kv_cache import KVCache
from runtime.request.sequence import Sequence, Status
from runtime.batching.slot_table import SlotTable


@dataclass
class StepPlan:
    """What one engine step runs: decode rows and (sequence, n_tokens) prompt chunks."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """FCFS admission within two budgets: `max_running` rows and `max_tokens_per_step` tokens.
    A prompt longer than the remaining budget is prefilled in chunks over several steps."""

    def __init__(self, cache: KVCache, max_running: int, max_tokens_per_step: int, min_prefix_reuse: int = 8):
        self.slots = SlotTable(cache)
        self.max_running = min(max_running, cache.spec.slots)
        self.max_tokens = max_tokens_per_step
        self.min_reuse = min_prefix_reuse
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        self._admit()
        plan, prefilling = StepPlan(), []
        for seq in self.running:  # Sequence.status is derived: read it once per sequence
            status = seq.status
            if status is Status.DECODE:
                plan.decode.append(seq)
            elif status is Status.PREFILL:
                prefilling.append(seq)
        budget = max(self.max_tokens - len(plan.decode), 1)
        for seq in prefilling:
            if budget > 0:
                n = min(seq.num_uncached_prompt, budget)
                plan.prefill.append((seq, n))
                budget -= n
        return plan

    def _admit(self) -> None:
        while self.waiting and self.slots.free and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            self.slots.admit(seq, self.min_reuse)
            self.running.append(seq)

    def advance(self, seqs: list[Sequence], n: int) -> None:
        """The KV of each sequence's next `n` tokens is cached (a prompt chunk, a decoded token, or accepted
        drafts plus one); a sequence whose whole prompt is cached is decoding from then on (Sequence.status)."""
        self.slots.advance(seqs, n)

    def retire(self, seq: Sequence) -> None:
        """Remove a finished or cancelled sequence and release its slot, keeping its KV findable."""
        if seq in self.running:
            self.running.remove(seq)
            self.slots.retire(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
