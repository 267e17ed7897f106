"""The slot table: which sequence holds each KV slot, how many of its tokens are cached there, and which
tokens a free slot's KV still holds, so that a later prompt can reuse that prefix.

The scheduler owns it and through it is the only writer of a sequence's slot and progress
(`Sequence.slot` / `num_cached` / `reused` are read-only); the KV cache holds only the buffers. What a
busy slot holds is derived from its owner (its prompt up to what is cached), never stored twice."""
from __future__ import annotations

import numpy as np

from runtime.model.kv_cache import KVCache
from runtime.request.sequence import Sequence


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


class SlotTable:
    """The slots of one KV cache: the `free` ones, each busy slot's `owner`, and for a slot without an
    owner the tokens whose KV it keeps (`kept`: a released sequence's tokens, or what `claim` found).

    Slots are taken and released, never compacted; a released slot keeps its tokens' KV until it is
    taken again, which is what prefix reuse finds."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.size, self.max_seq_len = cache.spec.slots, cache.spec.max_seq_len
        self.free = list(range(self.size))
        self.owner: list[Sequence | None] = [None] * self.size
        self.kept: list[list[int]] = [[] for _ in range(self.size)]

    @property
    def used(self) -> list[int]:
        return sorted(set(range(self.size)) - set(self.free))

    def held(self, slot: int) -> list[int]:
        """The token ids whose KV `slot` holds: its owner's cached prompt tokens, else what it kept."""
        owner = self.owner[slot]
        return self.kept[slot] if owner is None else owner.prompt_ids[:owner.num_cached]

    # -- sequences ------------------------------------------------------------------------------
    def admit(self, seq: Sequence, min_reuse: int) -> None:
        """Give `seq` a slot (`claim`): its leading prompt tokens found there count as cached."""
        slot, reuse = self.claim(seq.prompt_ids, min_reuse)
        self.owner[slot], self.kept[slot] = seq, []
        seq._slot, seq._cached, seq._reused = slot, reuse, reuse

    def advance(self, seqs: list[Sequence], n: int) -> None:
        """The KV of each sequence's next `n` tokens is now in its slot."""
        for seq in seqs:
            seq._cached += n

    def retire(self, seq: Sequence) -> None:
        """Release `seq`'s slot, keeping its cached tokens findable."""
        self.release(seq.slot, seq.all_ids[:seq.num_cached])

    def positions(self, lo: int, hi: int) -> np.ndarray:
        """Per slot in [lo, hi], the position a decode call writes: a busy slot's cached length, an idle
        slot's kept length (its dummy token lands just past the KV it keeps)."""
        return np.array([len(self.kept[s]) if (o := self.owner[s]) is None else o._cached
                         for s in range(lo, hi + 1)], dtype=np.int64)

    # -- slots ----------------------------------------------------------------------------------
    def claim(self, prompt: list[int], min_reuse: int) -> tuple[int, int]:
        """Take a slot for `prompt`; returns (slot, number of leading prompt tokens whose KV is
        already in it). A free slot holding the longest prefix is taken as is; a prefix held by a
        busy slot is copied into a fresh slot (`_fresh_slot`); otherwise a fresh slot starts empty."""
        if not self.free:
            raise RuntimeError("no free KV slot")
        limit = len(prompt) - 1  # the last prompt token is always computed: it yields the logits
        best = max(range(self.size), key=lambda s: (common_prefix(self.held(s), prompt[:limit]), s in self.free, -s))
        reuse = common_prefix(self.held(best), prompt[:limit])
        if reuse < min_reuse:
            slot = self._fresh_slot()
            self._take(slot)
            return slot, 0
        if best in self.free:
            self._take(best)
            self.kept[best] = prompt[:reuse]
            return best, reuse
        slot = self._fresh_slot()
        self._take(slot)
        self.cache.copy_prefix(best, slot, reuse)
        self.kept[slot] = prompt[:reuse]
        return slot, reuse

    def _fresh_slot(self) -> int:
        """A free slot for a prompt that reuses none of its contents. A decode call covers the range of
        busy slots, so a free slot inside it computes a dummy row anyway: fill such a hole first (an
        empty one before one whose released prompt may still be reused), else take the lowest slot
        above the range, which widens the call by the fewest rows."""
        top = max(self.used, default=-1)
        return min(self.free, key=lambda s: (0, len(self.kept[s]) > 0, s) if s < top else (1, s, 0))

    def _take(self, slot: int) -> None:
        self.free.remove(slot)
        self.kept[slot] = []

    def release(self, slot: int, tokens: list[int] | None = None) -> None:
        """Give a slot back; `tokens` (whose KV it holds) stay findable for prefix reuse. A decode call
        that covers the idle slot writes a dummy token just past them, so at most max_seq_len - 1 are
        kept (no prompt is that long: a prompt's reusable part is shorter still)."""
        if slot in self.free or not 0 <= slot < self.size:
            raise RuntimeError(f"KV slot {slot} is not in use")
        self.owner[slot] = None
        self.kept[slot] = list(tokens or [])[:self.max_seq_len - 1]
        self.free.append(slot)
