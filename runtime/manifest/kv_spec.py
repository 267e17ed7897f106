"""KVCacheSpec: the static KV-cache layout the builder plans and the runtime allocates."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVCacheSpec:
    """One key and one value buffer per layer, each [slots, kv_heads, max_seq_len, head_dim].

    `slots` is the number of sequences that can be resident at once (the batch upper bound).
    `sliding_window`: set when every layer attends only to its last `sliding_window` positions, so a
    cache of that length per sequence could in principle hold all that attention reads. The buffer still
    spans max_seq_len: GroupQueryAttention writes each token at its absolute position in the shared
    past/present buffer (no ring buffer), so a window-sized buffer would not be exact."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    slots: int
    max_seq_len: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ITEM_BYTES:
            raise ValueError(f"KV cache dtype {self.dtype!r} is not one of {sorted(ITEM_BYTES)}")
        for name in ("num_layers", "kv_heads", "head_dim", "slots", "max_seq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"KV cache {name} must be >= 1, got {getattr(self, name)}")

    @property
    def buffer_shape(self) -> tuple[int, int, int, int]:
        return (self.slots, self.kv_heads, self.max_seq_len, self.head_dim)

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.max_seq_len * self.head_dim * ITEM_BYTES[self.dtype]

    @property
    def bytes(self) -> int:
        return self.slots * self.bytes_per_slot

    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def resized(self, slots: int | None = None, max_seq_len: int | None = None) -> KVCacheSpec:
        return dataclasses.replace(self, slots=slots or self.slots, max_seq_len=max_seq_len or self.max_seq_len)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"bytes": self.bytes}

    @classmethod
    def from_dict(cls, data: dict) -> KVCacheSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})
