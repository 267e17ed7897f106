"""KV blocks of a paged engine (PagedAttention, CUDA): the scheduler's block ids ARE the ids of the device
pool's blocks (`[num_blocks, block_size, kv_heads, head_dim]` per layer), so a block holds the same KV
for every sequence whose block table names it.

Prefix caching shares blocks by reference, with no copy: each full block is keyed by a hash chained over
the blocks before it; a new sequence's table starts with the longest cached chain its tokens match (each
matched block's reference count goes up), and the KV of those tokens is not written again (slot_mapping
-1, runtime/model/paged_inputs.py). A sequence that ends gives its references back; a full block nobody
references stays cached, least recently used first out, until a block is needed and none is free.

Which sequence holds which row, and its progress, is runtime/batching/paged_table.py's PagedTable."""
from __future__ import annotations

from collections import OrderedDict

from runtime.manifest.arith import ceil_div
from runtime.batching.block_table import BlockConfig, Blocks, Prefix


class BlockPool(Blocks):
    """Reference-counted blocks (Blocks): `rows[slot]` a running sequence's block ids in token order, `present[slot]`
    how many of its first tokens' KV its shared blocks held when it was admitted (not to be written again);
    `index` maps a full block's chain hash to (block id, its tokens); `lru` the cached blocks with no
    reference, oldest first."""

    def __init__(self, config: BlockConfig, rows: int):
        super().__init__(config, rows)
        self.refs = [0] * config.num_blocks
        self.present = [0] * rows
        self.index: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.hash_of: dict[int, int] = {}  # block id -> its key in `index`
        self.lru: OrderedDict[int, None] = OrderedDict()

    def available(self, reviving: list[int] = ()) -> int:
        """Blocks a sequence could take now: free ones and cached ones nobody references, less `reviving`
        (cached blocks that sequence is about to share)."""
        return len(self.free_ids) + len(self.lru) - sum(1 for b in reviving if b in self.lru)

    def _prefix(self, chain: list[tuple[int, tuple]]) -> Prefix:
        """The cached blocks themselves (any row may share them: no `row`; a released row keeps nothing)."""
        return Prefix([h for h, _ in chain], [found[0] for _, found in chain], len(chain) * self.size)

    def share(self, row: int, prefix: Prefix) -> None:
        """`row` starts with the prefix's cached blocks, by reference (their KV is present)."""
        for block in prefix.blocks:
            self.refs[block] += 1
            self.lru.pop(block, None)
        self.rows[row], self.hashes[row], self.present[row] = list(prefix.blocks), list(prefix.hashes), prefix.tokens

    def reserve(self, row: int, tokens: int) -> bool:
        """Make `row` hold blocks for `tokens` tokens, evicting cached unreferenced blocks (least recently
        used first) when none is free; False, with nothing taken, when the budget cannot hold them."""
        need = ceil_div(tokens, self.size) - len(self.rows[row])
        if need > self.available():
            return False
        for _ in range(max(need, 0)):
            block = self.free_ids.popleft() if self.free_ids else self._evict()
            self.refs[block] = 1
            self.rows[row].append(block)
        return True

    def register(self, row: int, tokens: list[int], adapter: str | None = None) -> None:
        """`tokens` (a prefix of what `row` holds, under LoRA `adapter`) are computed: index its full blocks not yet indexed. A block
        whose tokens another block already caches stays private (the index keeps the first)."""
        for i, h in self._hash_new_blocks(row, tokens, len(tokens) // self.size, adapter):
            block = self.rows[row][i]
            if h not in self.index and block not in self.hash_of:
                self.index[h], self.hash_of[block] = (block, tuple(tokens[i * self.size:(i + 1) * self.size])), h

    def release(self, row: int) -> None:
        """The row's sequence is gone: each block loses a reference; an unreferenced block stays cached when
        indexed (its tail first in line for eviction, so a prefix outlives its continuations), else is free."""
        for block in reversed(self.rows[row]):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.lru[block] = None
                else:
                    self.free_ids.append(block)
        self.rows[row], self.hashes[row], self.present[row] = [], [], 0

    def _evict(self) -> int:
        block, _ = self.lru.popitem(last=False)
        del self.index[self.hash_of.pop(block)]
        return block
