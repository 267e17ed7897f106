"""The one KV interface the scheduler and the executor use, whatever the engine's KV layout: a `KVTable` gives
a sequence a row and blocks (`admit`), more blocks as it grows (`grow`), records its progress (`advance`), frees
them (`retire`, `preempt`), finds cached prefixes, and lays out a step's engine calls (`calls`) and a one-row
call's KV (`place`), which the run stage hands to the runner with the call.

Two layouts implement it, and runtime/batching/kv_layout.py is the one place that tells them apart, from the KV
cache the engine loaded (runtime/engine.py chose the runner, and so the cache, once): contiguous max_seq_len rows
(runtime/batching/slot_table.py's SlotTable; GroupQueryAttention, CPU and CUDA; block ids are accounting only,
runtime/batching/block_table.py) and paged blocks (runtime/batching/paged_table.py's PagedTable; PagedAttention,
CUDA; the block ids are the device pool's, runtime/batching/block_pool.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from runtime.batching.block_table import Blocks
from runtime.request.sequence import Sequence


class KVTable(ABC):
    """The rows of one KV cache: the `free` ones and each busy row's `owner`; `blocks` charges their tokens to the
    KV budget and finds cached prefixes by block hash. `mirrors`: other caches whose rows follow these (a draft
    engine's), handed back with them. The scheduler owns it, and through it is the only writer of a sequence's
    slot and progress. A layout implements `admit`, `calls` and `place`."""

    def __init__(self, cache, blocks: Blocks, mirrors: tuple = ()):
        self.cache, self.blocks, self.mirrors = cache, blocks, mirrors
        self.size, self.max_seq_len = cache.spec.slots, cache.spec.max_seq_len
        self.free = list(range(self.size))
        self.owner: list[Sequence | None] = [None] * self.size

    @property
    def used(self) -> list[int]:
        return sorted(set(range(self.size)) - set(self.free))

    # -- sequences ------------------------------------------------------------------------------
    @abstractmethod
    def admit(self, seq: Sequence, min_reuse: int, chunk: int, watermark: int = 0) -> bool:
        """Give `seq` a row and the blocks of its first prefill chunk (`chunk` tokens past the longest cached
        prefix it reuses, at least `min_reuse` tokens); False, changing nothing, when the blocks (and `watermark`
        spare blocks) do not fit the budget."""

    def grow(self, seq: Sequence, tokens: int) -> bool:
        """Blocks for `seq`'s first `tokens` tokens (at most max_seq_len); False when they do not fit."""
        return self.blocks.reserve(seq.slot, min(tokens, self.max_seq_len))

    def advance(self, seqs: list[Sequence], n: int) -> None:
        """The KV of each sequence's next `n` tokens is now in its row; its newly full blocks are indexed."""
        size, caching = self.blocks.size, self.blocks.config.prefix_caching
        for seq in seqs:
            seq._cached += n
            if caching and seq._cached // size > len(self.blocks.hashes[seq._slot]):  # a block just filled
                self.blocks.register(seq._slot, seq.all_ids[:seq._cached], seq.params.adapter)

    def retire(self, seq: Sequence) -> None:
        """Release `seq`'s row, keeping its cached full blocks findable."""
        self.blocks.register(seq.slot, seq.all_ids[:seq.num_cached], seq.params.adapter)
        self.release(seq.slot)

    def preempt(self, seq: Sequence) -> None:
        """Take `seq`'s row and blocks away; it will recompute its prompt and generated tokens (its full
        blocks stay cached, so a readmission may find them)."""
        self.retire(seq)
        seq._slot, seq._cached, seq._reused, seq._recomputed = -1, 0, 0, len(seq.output_ids)

    def release(self, slot: int) -> None:
        """Give a row back; the full blocks it caches stay findable."""
        if slot in self.free or not 0 <= slot < self.size:
            raise RuntimeError(f"KV slot {slot} is not in use")
        if (owner := self.owner[slot]) is not None:
            owner._blocks = []  # the row's blocks stay with the row (cached, or freed)
        self.owner[slot] = None
        self.blocks.release(slot)
        self.free.append(slot)
        for mirror in self.mirrors:  # a draft's KV is caught up from scratch in a sequence's next row
            mirror.release_row(slot)

    def _seat(self, seq: Sequence, slot: int, reuse: int) -> None:
        """`seq` holds `slot` now, its first `reuse` tokens cached there, and carries the row's blocks."""
        self.free.remove(slot)
        self.owner[slot] = seq
        seq._slot, seq._cached, seq._reused = slot, reuse, reuse
        seq._blocks = self.blocks.rows[slot]

    # -- steps ----------------------------------------------------------------------------------
    def compact(self, running: list[Sequence], movable, moves: int = 0) -> int:
        """Move sequences into lower rows so decode calls carry fewer idle rows; returns the moves made (none
        where a call runs exactly its rows)."""
        return 0

    def cool(self, rode: list[int]) -> None:
        """Rows that rode along in a decode call without a sequence of their own (none where a call runs
        exactly its rows)."""

    @abstractmethod
    def calls(self, runner, decode: list[Sequence], prefill: list[tuple[Sequence, int]]) -> list:
        """A step's engine calls (runtime/batching/decode.py) for decode rows (one new token each) and
        (sequence, n) prompt chunks, their inputs fixed now (a decode call `advance`s itself for the next step
        of the same rows): calls without a prompt chunk first."""

    @abstractmethod
    def place(self, seq: Sequence):
        """What a one-row call (`runner.extend`: a verify) needs of `seq`'s KV."""

