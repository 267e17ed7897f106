"""KVCacheSpec: the static KV-cache layout the builder plans and the runtime allocates."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from runtime.manifest.arith import ceil_div

ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
STORAGE = ("int8",)  # quantized KV element types: codes with static per-channel scales inside the graph


@dataclass(frozen=True)
class KVCacheSpec:
    """One key and one value buffer per layer, each [slots, kv_heads, max_seq_len, head_dim].

    `slots` is the number of sequences that can be resident at once (the batch upper bound).
    `sliding_window`: set when every layer attends only to its last `sliding_window` positions, so a
    cache of that length per sequence could in principle hold all that attention reads. The buffer still
    spans max_seq_len: GroupQueryAttention writes each token at its absolute position in the shared
    past/present buffer (no ring buffer), so a window-sized buffer would not be exact.

    `dtype` is the attention's compute dtype (the engine's activations). `storage` None keeps the cache in
    it; "int8" stores int8 codes: GroupQueryAttention quantizes each new K (after rotary) and V with the
    static per-channel scales the builder calibrated (initializers of the graph, [kv_heads, 1, head_dim]),
    and dequantizes them when it reads the cache.

    `block_size` set: a paged engine (PagedAttention, CUDA): each layer's key and value are one pool of
    `num_blocks` blocks [num_blocks, block_size, kv_heads, head_dim], as many tokens as the slots would
    hold; a sequence holds the blocks its tokens need (runtime/model/paged_inputs.py)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    slots: int
    max_seq_len: int
    sliding_window: int | None = None
    storage: str | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ITEM_BYTES or self.dtype in STORAGE:
            raise ValueError(f"KV cache dtype {self.dtype!r} is not one of {sorted(set(ITEM_BYTES) - set(STORAGE))}")
        if self.block_size is not None and int(self.block_size) < 1:
            raise ValueError(f"KV cache block_size must be >= 1 (or null: no paging), got {self.block_size}")
        if self.storage is not None and self.storage not in STORAGE:
            raise ValueError(f"KV cache storage {self.storage!r} is not one of {list(STORAGE)} (or null: the dtype)")
        for name in ("num_layers", "kv_heads", "head_dim", "slots", "max_seq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"KV cache {name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_blocks(self) -> int | None:
        """A paged engine's pool: the blocks of `slots` sequences of max_seq_len tokens (None unpaged)."""
        return None if self.block_size is None else self.slots * ceil_div(self.max_seq_len, self.block_size)

    @property
    def buffer_shape(self) -> tuple[int, int, int, int]:
        if self.block_size is not None:
            return (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        return (self.slots, self.kv_heads, self.max_seq_len, self.head_dim)

    @property
    def storage_dtype(self) -> str:
        """The element type of the KV buffers: `storage` when quantized, else `dtype`."""
        return self.storage or self.dtype

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, keys and values."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * ITEM_BYTES[self.storage_dtype]

    @property
    def bytes_per_slot(self) -> int:
        return self.max_seq_len * self.bytes_per_token

    @property
    def bytes(self) -> int:
        if self.block_size is not None:
            return self.num_blocks * self.block_size * self.bytes_per_token
        return self.slots * self.bytes_per_slot

    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.storage_dtype)

    def resized(self, slots: int | None = None, max_seq_len: int | None = None) -> KVCacheSpec:
        return dataclasses.replace(self, slots=slots or self.slots, max_seq_len=max_seq_len or self.max_seq_len)

    def to_dict(self) -> dict:
        paged = {} if self.block_size is None else {"num_blocks": self.num_blocks}
        return dataclasses.asdict(self) | {"bytes": self.bytes, "bytes_per_token": self.bytes_per_token} | paged

    @classmethod
    def from_dict(cls, data: dict) -> KVCacheSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})
