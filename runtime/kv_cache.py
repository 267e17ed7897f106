"""The static KV cache: one key and one value buffer per layer, allocated once from the engine's
KVCacheSpec and updated in place by the attention kernel. Slots are taken and released, never copied."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.kv_spec import KVCacheSpec


class KVCache:
    """Buffers `[slots, kv_heads, max_seq_len, head_dim]` per layer plus a free list of slots."""

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec
        dtype = spec.numpy_dtype()
        self.keys = [np.zeros(spec.buffer_shape, dtype) for _ in range(spec.num_layers)]
        self.values = [np.zeros(spec.buffer_shape, dtype) for _ in range(spec.num_layers)]
        self.free = list(range(spec.slots))
        self._views: dict[tuple[int, int], list[tuple[ort.OrtValue, ort.OrtValue]]] = {}

    def allocate(self, count: int = 1) -> list[int]:
        """Take `count` contiguous free slots (lowest first); a run of rows is one kernel call."""
        free = sorted(self.free)
        for i in range(len(free) - count + 1):
            run = free[i:i + count]
            if run[-1] - run[0] == count - 1:
                for slot in run:
                    self.free.remove(slot)
                return run
        raise RuntimeError(f"no {count} contiguous free KV slots (free: {free})")

    def release(self, slot: int) -> None:
        if slot in self.free or not 0 <= slot < self.spec.slots:
            raise RuntimeError(f"KV slot {slot} is not in use")
        self.free.append(slot)

    def views(self, start: int, stop: int) -> list[tuple[ort.OrtValue, ort.OrtValue]]:
        """OrtValues over rows [start, stop) of every layer's buffers, sharing their memory."""
        key = (start, stop)
        if key not in self._views:
            self._views[key] = [(ort.OrtValue.ortvalue_from_numpy(k[start:stop]),
                                 ort.OrtValue.ortvalue_from_numpy(v[start:stop]))
                                for k, v in zip(self.keys, self.values)]
        return self._views[key]
