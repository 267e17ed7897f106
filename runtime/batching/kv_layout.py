"""Which KV table an engine's cache gets: the one place that tells the two KV layouts apart
(runtime/batching/kv_table.py's interface; the engine's runner, and so its cache, was chosen at load by
runtime/engine.py)."""
from __future__ import annotations

from runtime.manifest.arith import ceil_div
from runtime.batching.block_pool import BlockPool
from runtime.batching.block_table import BlockConfig, BlockTable
from runtime.batching.kv_table import KVTable
from runtime.batching.paged_table import PagedTable
from runtime.batching.slot_table import SlotTable


def kv_table(cache, blocks: BlockConfig | None = None, mirrors: tuple = ()) -> KVTable:
    """The KV table of `cache`'s layout: paged blocks when its spec has a block size (the device pool's blocks),
    else contiguous rows with `blocks` as their accounting (default: every row's max_seq_len in blocks of 16)."""
    spec = cache.spec
    size = spec.block_size or 16
    blocks = blocks or BlockConfig(spec.slots * ceil_div(spec.max_seq_len, size), size)
    if spec.block_size is not None:
        return PagedTable(cache, BlockPool(blocks, spec.slots), mirrors)
    return SlotTable(cache, BlockTable(blocks, spec.slots, spec.max_seq_len), mirrors)
