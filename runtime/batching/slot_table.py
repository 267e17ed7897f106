"""The slot table: the KV table (runtime/batching/kv_table.py) of contiguous rows, one max_seq_len row of the
KV cache per sequence (GroupQueryAttention's layout): which sequence holds each row (slot), how many of its
tokens are cached there, and which tokens a free row's KV still holds; the KV budget itself is charged by the
block (runtime/batching/block_table.py), so a row costs only the blocks its tokens fill. A decode call covers a
range of rows (runtime/batching/decode.py), so the table also moves sequences down into empty rows
(`compact`) and lets idle rows give up what they keep (`cool`).

The scheduler owns it and through it is the only writer of a sequence's slot and progress
(`Sequence.slot` / `num_cached` / `reused` / `recomputed` are read-only); the KV cache holds only the
buffers. What a busy row holds is derived from its owner, never stored twice."""
from __future__ import annotations

import operator
from typing import Callable

import numpy as np

from runtime.batching import decode
from runtime.manifest.arith import ceil_div
from runtime.batching.block_table import BlockTable
from runtime.batching.kv_table import KVTable
from runtime.model.kv_cache import KVCache
from runtime.request.sequence import Sequence


# decode calls a free row rides along in, keeping its cached blocks, before it gives them up (SlotTable.cool)
IDLE_GRACE = 4
# sequences moved down into empty rows per step at most (SlotTable.compact): each move copies its KV
COMPACT_MOVES = 2
_SLOT = operator.attrgetter("_slot")


class SlotTable(KVTable):
    """The rows of one KV cache (KVTable), and for a row without an owner the tokens whose KV it keeps
    (`kept`: the full blocks a released sequence left cached). `blocks` is the budget's accounting."""

    def __init__(self, cache: KVCache, blocks: BlockTable, mirrors: tuple[KVCache, ...] = ()):
        super().__init__(cache, blocks, mirrors)
        self.kept: list[list[int]] = [[] for _ in range(self.size)]
        self.idle = [0] * self.size  # decode calls a free row has ridden along in with cached blocks

    def held(self, slot: int) -> list[int]:
        """The token ids whose KV `slot` holds: its owner's cached tokens, else what it kept."""
        owner = self.owner[slot]
        if owner is None:
            return self.kept[slot][:self.blocks.cached_tokens(slot)]  # an evicted row keeps nothing
        return owner.all_ids[:owner.num_cached]

    # -- sequences ------------------------------------------------------------------------------
    def admit(self, seq: Sequence, min_reuse: int, chunk: int, watermark: int = 0) -> bool:
        """Give `seq` a row and the blocks of its first prefill chunk (`chunk` tokens past what it reuses, of its
        prompt plus, after a preemption, its generated tokens), reusing the longest cached prefix any row holds: in place when that row is free, else copied into a fresh row. Later chunks take
        their blocks as they run (Scheduler.schedule). False, changing nothing, when the blocks (and `watermark`
        spare blocks) do not fit the budget."""
        ids = seq.prefill_ids
        found = self.blocks.match(ids[:len(ids) - 1], seq.params.adapter)  # the last token is computed: it yields the logits
        source, reuse = (found.row, found.tokens) if found.tokens >= min_reuse else (-1, 0)
        tokens = min(len(ids), reuse + chunk)
        slot = source if source in self.free else self._fresh_slot(avoid=source)
        spare = len(self.blocks.free_ids) + self.blocks.evictable(keep=source)
        if slot == source:
            spare += len(self.blocks.rows[slot]) - reuse // self.blocks.size
        if ceil_div(tokens, self.blocks.size) - (reuse // self.blocks.size if slot == source else 0) + watermark > spare:
            return False
        self.blocks.take(slot, reuse if slot == source else 0)
        self._hand_back()  # before the copy below: a fresh row's old pages go first
        if slot != source and reuse:
            self.cache.copy_prefix(source, slot, reuse)
            self.blocks.touch(source)
        self.blocks.reserve(slot, tokens, keep=source)
        self._hand_back()
        self._seat(seq, slot, reuse)
        self.kept[slot] = []
        self.blocks.register(slot, ids[:reuse], seq.params.adapter)
        return True

    def compact(self, running: list[Sequence], movable: Callable[[Sequence], bool], moves: int = COMPACT_MOVES) -> int:
        """Move the sequence in the highest busy row into the lowest empty row below it, copying its KV, up to
        `moves` times while that sequence is `movable` (decoding), so a decode call over the range of busy rows
        carries fewer idle rows: on a CPU every row of a call costs its share of the matmuls, and an idle one buys
        nothing. Only empty rows are filled (a free row keeping cached blocks stays findable), and nothing moves
        where mirrors follow these rows (a draft's KV would have to move too). `running`: every sequence holding a
        row. Returns the moves made."""
        made = 0
        while made < moves and self.free and running and not self.mirrors:
            top = max(running, key=_SLOT)
            if min(self.free) > top._slot or not movable(top):  # the common step: no free row below the top
                return made
            holes = [r for r in self.free if r < top._slot and not self.blocks.rows[r] and r not in self.blocks.lru]
            if not holes:
                return made
            self._move(top, min(holes))
            made += 1
        return made

    def _move(self, seq: Sequence, dst: int) -> None:
        src = seq.slot
        self.cache.copy_prefix(src, dst, seq.num_cached)
        self.blocks.move(src, dst)
        self._hand_back()
        self.free.remove(dst)
        self.free.append(src)
        self.owner[dst], self.owner[src] = seq, None
        self.kept[dst], self.kept[src], self.idle[src] = [], [], 0
        seq._slot = dst

    def positions(self, lo: int, hi: int) -> np.ndarray:
        """Per row in [lo, hi], the position a decode call writes: a busy row's cached length, an idle
        row's kept length (its dummy token lands just past the KV it keeps)."""
        return np.array([self.blocks.cached_tokens(s) if (o := self.owner[s]) is None else o._cached
                         for s in range(lo, hi + 1)], dtype=np.int64)

    def cool(self, rode: list[int]) -> None:
        """Rows that rode along in a decode call without a sequence of their own: a free one's dummy token
        attended over the blocks it keeps (work that buys nothing at a 0% hit rate), so after riding along
        IDLE_GRACE calls without being reused it gives them up. Rows no call covers keep theirs: they cost nothing."""
        for row in rode:
            if self.owner[row] is None and self.blocks.cached_tokens(row):
                self.idle[row] += 1
                if self.idle[row] >= IDLE_GRACE:
                    self.evict(row)

    def evict(self, row: int) -> None:
        """A free row forgets its cached blocks: they are free, and its pages go back to the OS."""
        self.blocks.evict(row)
        self._hand_back()

    # -- rows -----------------------------------------------------------------------------------
    def grow(self, seq: Sequence, tokens: int) -> bool:
        """KVTable.grow; the cached rows whose blocks it evicted hand their pages back."""
        grown = super().grow(seq, tokens)
        self._hand_back()
        return grown

    def _hand_back(self) -> None:
        """The pages of the KV the block table dropped go back to the OS, in this cache and its mirrors, in the
        order it dropped them: this table, not the block table, tells the caches (data flows one way)."""
        if not self.blocks.dropped:  # most calls drop nothing (a decode step's growth)
            return
        for row, start in self.blocks.take_dropped():
            for cache in (self.cache,) + self.mirrors:
                cache.release_row(row, start)

    def _fresh_slot(self, avoid: int = -1) -> int:
        """A free row for a prompt that reuses none of its contents. A decode call covers the range of
        busy rows, so a free row inside it computes a dummy row anyway: fill such a hole first (an empty
        one before one whose cached blocks may still be reused, and among those the least recently used),
        else take the lowest row above the range, which widens the call by the fewest rows (its cached blocks
        go: every row above it would cost each decode call a dummy row)."""
        top = max(self.used, default=-1)
        age = {row: i for i, row in enumerate(self.blocks.lru)}
        return min((s for s in self.free if s != avoid),
                   key=lambda s: (0, s in age, age.get(s, 0), s) if s < top else (1, s, 0, 0))

    def release(self, slot: int) -> None:
        """KVTable.release; the row keeps the tokens of its cached full blocks (at most max_seq_len - 1 tokens: a
        decode call that covers the idle row writes a dummy token just past them)."""
        owner = self.owner[slot]
        super().release(slot)
        self._hand_back()
        self.kept[slot] = owner.all_ids[:self.blocks.cached_tokens(slot)] if owner is not None else []
        self.idle[slot] = 0

    # -- calls ----------------------------------------------------------------------------------
    def calls(self, runner, decode_rows: list[Sequence], prefill: list[tuple[Sequence, int]]) -> list:
        """The decode rows in calls over ranges of rows (runtime/batching/decode.py `decode_calls`), then one call
        per prompt chunk: GroupQueryAttention on a CPU cannot mix a multi-token row with decode rows."""
        calls = decode.decode_calls(runner, self, decode_rows) if decode_rows else []
        return calls + [decode.ChunkCall(seq, n) for seq, n in prefill]

    def place(self, seq: Sequence) -> int:
        """A one-row call runs on the sequence's row."""
        return seq.slot
