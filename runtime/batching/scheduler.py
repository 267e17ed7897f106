"""Iteration-level scheduling: every step decodes one token for each running sequence and spends
what is left of the token budget on prompt chunks, admitting waiting sequences first come first
served while their KV blocks fit the budget, and preempting the most recently admitted sequence when
the running ones' next blocks do not (it recomputes later). The scheduler owns sequence state: rows and
progress and blocks go through its KV table (runtime/batching/kv_table.py: contiguous rows or paged blocks, chosen
by runtime/batching/kv_layout.py), and whoever computes tokens reports them with `advance`."""
from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

from runtime.batching.block_table import BlockConfig
from runtime.batching.kv_layout import kv_table
from runtime.model.kv_cache import KVCache
from runtime.request.sequence import Sequence, Status


@dataclass
class StepPlan:
    """What one engine step runs: decode rows and (sequence, n_tokens) prompt chunks; `steps` > 1: the decode
    rows' next `steps` tokens, run back to back (Scheduler.run_ahead)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    steps: int = 1

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """FCFS admission within three budgets: `max_running` rows, `max_tokens_per_step` tokens and the KV
    blocks of `blocks` (default: every row's max_seq_len, what the cache's rows hold). A prompt longer than
    the remaining token budget is prefilled in chunks over several steps. `mirrors`: caches whose rows
    follow the cache's (a draft engine's). `compaction`: move decoding sequences down into empty rows (KVTable.compact)."""

    def __init__(self, cache: KVCache, max_running: int, max_tokens_per_step: int, min_prefix_reuse: int = 8,
                 blocks: BlockConfig | None = None, mirrors: tuple[KVCache, ...] = (), compaction: bool = True,
                 adapters=None):
        """`adapters`: the engine's AdapterPool (runtime/lora/pool.py), when it has LoRA inputs: a sequence on an
        adapter is admitted once the adapter has a device slot; until then it waits, and later ones may pass it."""
        self.adapters = adapters
        self.slots = kv_table(cache, blocks, mirrors)  # the one KV interface, for the cache's layout
        self.compaction = compaction
        self.blocks = self.slots.blocks
        self.max_running = min(max_running, cache.spec.slots)
        self.max_tokens = max_tokens_per_step
        self.min_reuse = min_prefix_reuse
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = {"preemptions": 0, "recomputed_tokens": 0, "moved_sequences": 0, "prefix_cache_hit_tokens": 0,
                         "prefix_cache_queries_tokens": 0, "kv_live_token_steps": 0, "kv_allocated_token_steps": 0}
        self._kv_now = (0, 0, 0)  # the last step's (blocks used, blocks held by running sequences, live tokens)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """Running sequences first, in admission order: blocks for each decoding sequence's next token and for
        each prefilling one's next chunk (what is left of the token budget after the decode rows), preempting
        the most recently admitted sequences when they do not fit; then waiting sequences are admitted while
        the step's token budget has room for a chunk of theirs (vLLM's order). Blocks are taken as tokens are
        about to be written, never for a whole prompt ahead, and a sequence enters a row only when it computes
        there this step: the blocks running sequences hold are their cached tokens plus this step's."""
        plan = StepPlan()
        if self.compaction:
            self.counters["moved_sequences"] += self.slots.compact(self.running, _movable)
        statuses = [(seq, seq.status) for seq in self.running]  # Sequence.status is derived: read it once
        budget = max(self.max_tokens - sum(status is Status.DECODE for _, status in statuses), 1)
        for seq, status in statuses:
            if seq.slot < 0:  # preempted below for an earlier sequence's blocks
                continue
            if status is Status.DECODE:
                if self._grow(seq, seq.num_cached + 1 + (seq.speculation.config.max_draft if seq.speculation is not None else 0)):
                    plan.decode.append(seq)
            elif status is Status.PREFILL and budget > 0:
                n = min(seq.num_uncached_prompt, budget)
                if self._grow(seq, seq.num_cached + n):
                    plan.prefill.append((seq, n))
                    budget -= n
        if budget > 0 and not any(seq.slot < 0 for seq, _ in statuses):  # none preempted: room to admit
            budget = self._admit(plan, budget)
        self._sample_kv()
        return plan

    def run_ahead(self, plan: StepPlan, steps: int) -> None:
        """Schedule a decode-only plan's next `steps` steps at once (multi-step): the blocks for `steps` tokens
        of each row are taken now and `plan.steps` says how many the engine runs back to back (fewer when a
        row's max_new_tokens ends sooner). Left at one step when the plan has prompt chunks, when a waiting
        sequence could take a row, or when the blocks do not fit (a step run ahead preempts nothing)."""
        steps = min([steps] + [s.params.max_new_tokens - len(s.output_ids) for s in plan.decode])
        if steps < 2 or plan.prefill or not plan.decode or self.could_admit:
            return
        if all(self.slots.grow(seq, seq.num_cached + steps) for seq in plan.decode):
            plan.steps = steps

    @property
    def could_admit(self) -> bool:
        """Whether a waiting sequence has a row to go to (its blocks aside)."""
        return bool(self.waiting) and bool(self.slots.free) and len(self.running) < self.max_running

    def _admit(self, plan: StepPlan, budget: int) -> int:
        """Admit waiting sequences in order while a row is free, the token budget has room and the blocks of
        their first chunk fit, keeping one spare block per running sequence (each may need one more at its next
        token); each one's first chunk joins `plan`. Returns the budget left."""
        while budget > 0 and self.could_admit:
            seq = self._next_waiting()
            if seq is None:
                break
            min_reuse = self.min_reuse if seq.params.prompt_logprobs is None else sys.maxsize  # scored: computed
            if not self.slots.admit(seq, min_reuse, budget, watermark=len(self.running)):
                break
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            self.running.append(seq)
            self.counters["prefix_cache_hit_tokens"] += seq.reused
            self.counters["prefix_cache_queries_tokens"] += len(seq.prefill_ids)
            if seq.recomputed:
                self.counters["recomputed_tokens"] += len(seq.prefill_ids) - seq.reused
            n = min(seq.num_uncached_prompt, budget)
            plan.prefill.append((seq, n))
            budget -= n
        return budget

    def _next_waiting(self) -> Sequence | None:
        """The first waiting sequence that can run now: any, without LoRA; else the first whose adapter has (or
        gets) a device slot (AdapterPool.reserve)."""
        if self.adapters is None:
            return self.waiting[0]
        return next((s for s in self.waiting if self.adapters.reserve(s.params.adapter, self.running)), None)

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Blocks for `seq`'s first `tokens` tokens (those it writes this step: its next token, for a
        speculating sequence room for its longest draft, or a prompt chunk), preempting the most recently
        admitted sequences until they fit; False when `seq` itself was preempted."""
        while not self.slots.grow(seq, tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's row and blocks and queue it first: it will prefill its prompt and
        the tokens it generated again (recompute) and go on from there."""
        self.running.remove(seq)
        self.slots.preempt(seq)
        if seq.speculation is not None:
            seq.speculation.draft_cached = 0  # its draft KV went with the row
        self.waiting.appendleft(seq)
        self.counters["preemptions"] += 1

    def advance(self, seqs: list[Sequence], n: int) -> None:
        """The KV of each sequence's next `n` tokens is cached (a prompt chunk, a decoded token, or accepted
        drafts plus one); a sequence whose whole prompt is cached is decoding from then on (Sequence.status)."""
        self.slots.advance(seqs, n)

    def _sample_kv(self) -> None:
        """Blocks in use, those running sequences hold, and the tokens they have cached, once per step."""
        held = sum(len(s.blocks) for s in self.running)
        self._kv_now = used, held, live = self.blocks.used, held, sum(s.num_cached for s in self.running)
        if held:
            self.counters["kv_live_token_steps"] += live
            self.counters["kv_allocated_token_steps"] += held * self.blocks.size

    def kv_stats(self) -> dict:
        """KV blocks in the budget and in use (running sequences' and cached ones), the tokens running sequences
        have cached at the last step (`kv_live_tokens_now`), preemption and prefix-cache counters, and waste: the
        share of the blocks running sequences hold that no live token fills, at the last step and over every step
        so far (from `kv_live_token_steps` / `kv_allocated_token_steps`: sums over steps, not counts; their old
        names `kv_live_tokens` / `kv_allocated_tokens` still read them)."""
        used, held, live = self._kv_now
        live_steps, allocated = self.counters["kv_live_token_steps"], self.counters["kv_allocated_token_steps"]
        return {**self.counters, "kv_live_tokens": live_steps, "kv_allocated_tokens": allocated,
                "kv_live_tokens_now": live, "kv_blocks_total": self.blocks.num_blocks, "kv_blocks_used": used,
                "kv_block_size": self.blocks.size, "kv_waste_ratio": 1.0 - live / (held * self.blocks.size) if held else 0.0,
                "kv_waste_ratio_mean": 1.0 - live_steps / allocated if allocated else 0.0}

    def retire(self, seq: Sequence) -> None:
        """Remove a finished or cancelled sequence and release its slot, keeping its KV findable."""
        if seq in self.running:
            self.running.remove(seq)
            self.slots.retire(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


def _movable(seq: Sequence) -> bool:
    """A sequence compaction may move: decoding (its whole prompt cached) and not speculating."""
    return seq.speculation is None and seq.status is Status.DECODE
