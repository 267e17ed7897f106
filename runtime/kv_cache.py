"""The static KV cache: one key and one value buffer per layer, allocated once from the engine's
KVCacheSpec and updated in place by the attention kernel. Slots are taken and released, never
compacted; a released slot keeps its tokens' KV until it is reused, which is what prefix reuse finds."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.kv_spec import KVCacheSpec


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


class KVCache:
    """Buffers `[slots, kv_heads, max_seq_len, head_dim]` per layer, a free list, and for every slot
    the token ids whose KV it holds (`contents`)."""

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec
        dtype = spec.numpy_dtype()
        self.keys = [np.zeros(spec.buffer_shape, dtype) for _ in range(spec.num_layers)]
        self.values = [np.zeros(spec.buffer_shape, dtype) for _ in range(spec.num_layers)]
        self.free = list(range(spec.slots))
        self.contents: list[list[int]] = [[] for _ in range(spec.slots)]
        self._views: dict[tuple[int, int], list[tuple[ort.OrtValue, ort.OrtValue]]] = {}

    @property
    def used(self) -> list[int]:
        return sorted(set(range(self.spec.slots)) - set(self.free))

    def allocate(self, count: int = 1) -> list[int]:
        """Take `count` contiguous free slots (lowest first); a run of rows is one kernel call."""
        free = sorted(self.free)
        for i in range(len(free) - count + 1):
            run = free[i:i + count]
            if run[-1] - run[0] == count - 1:
                for slot in run:
                    self._take(slot)
                return run
        raise RuntimeError(f"no {count} contiguous free KV slots (free: {free})")

    def claim(self, prompt: list[int], min_reuse: int) -> tuple[int, int]:
        """Take a slot for `prompt`; returns (slot, number of leading prompt tokens whose KV is
        already in it). A free slot holding the longest prefix is taken as is; a prefix held by a
        busy slot is copied into a fresh slot (`_fresh_slot`); otherwise a fresh slot starts empty."""
        if not self.free:
            raise RuntimeError("no free KV slot")
        limit = len(prompt) - 1  # the last prompt token is always computed: it yields the logits
        best = max(range(self.spec.slots), key=lambda s: (common_prefix(self.contents[s], prompt[:limit]),
                                                           s in self.free, -s))
        reuse = common_prefix(self.contents[best], prompt[:limit])
        if reuse < min_reuse:
            slot = self._fresh_slot()
            self._take(slot)
            return slot, 0
        if best in self.free:
            self._take(best)
            self.contents[best] = prompt[:reuse]
            return best, reuse
        slot = self._fresh_slot()
        self._take(slot)
        for k, v in zip(self.keys, self.values):
            k[slot, :, :reuse] = k[best, :, :reuse]
            v[slot, :, :reuse] = v[best, :, :reuse]
        self.contents[slot] = prompt[:reuse]
        return slot, reuse

    def _fresh_slot(self) -> int:
        """A free slot for a prompt that reuses none of its contents. A decode call covers the range of
        busy slots, so a free slot inside it computes a dummy row anyway: fill such a hole first (an
        empty one before one whose released prompt may still be reused), else take the lowest slot
        above the range, which widens the call by the fewest rows."""
        top = max(self.used, default=-1)
        return min(self.free, key=lambda s: (0, len(self.contents[s]) > 0, s) if s < top else (1, s, 0))

    def _take(self, slot: int) -> None:
        self.free.remove(slot)
        self.contents[slot] = []

    def release(self, slot: int, tokens: list[int] | None = None) -> None:
        """Give a slot back; `tokens` (whose KV it holds) stay findable for prefix reuse."""
        if slot in self.free or not 0 <= slot < self.spec.slots:
            raise RuntimeError(f"KV slot {slot} is not in use")
        self.contents[slot] = list(tokens or [])
        self.free.append(slot)

    def views(self, start: int, stop: int) -> list[tuple[ort.OrtValue, ort.OrtValue]]:
        """OrtValues over rows [start, stop) of every layer's buffers, sharing their memory."""
        key = (start, stop)
        if key not in self._views:
            self._views[key] = [(ort.OrtValue.ortvalue_from_numpy(k[start:stop]),
                                 ort.OrtValue.ortvalue_from_numpy(v[start:stop]))
                                for k, v in zip(self.keys, self.values)]
        return self._views[key]
