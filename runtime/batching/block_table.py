"""KV memory by the block: the budget is `num_blocks` blocks of `block_size` tokens, a row (a sequence's
slot) holds the blocks that cover its tokens, and each full block is findable by a hash chained over the
blocks before it, so a later prompt can reuse the longest prefix any row holds (prefix caching).

On CPU a block id is accounting only: GroupQueryAttention keeps each sequence's KV in one contiguous
max_seq_len row, so block `i` of a row is that row's positions [i * block_size, (i + 1) * block_size).
A released row keeps its hashed blocks (cached, still charged to the budget) until their memory is
needed: blocks are evicted one by one, from the least recently used cached row, its last blocks first (a
prefix outlives its continuations, as in vLLM), and their pages handed back to the OS. Rows, not blocks,
are what LRU orders: a row's blocks were all last used together (by the sequence that held them), and a
block in the middle of a row cannot be given to another sequence anyway, whose tokens need a row of their
own (GroupQueryAttention reads a sequence's KV as one contiguous run of its row)."""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterator

from runtime.manifest.arith import ceil_div


@dataclass(frozen=True)
class BlockConfig:
    """How KV memory is charged: `num_blocks` blocks of `block_size` tokens; `prefix_caching` keeps and
    reuses full blocks by hash; `identity` seeds the hash chain (the engine, so two engines never match)."""

    num_blocks: int
    block_size: int = 16
    prefix_caching: bool = True
    identity: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def for_budget(cls, budget_bytes: int, bytes_per_token: int, max_seq_len: int, block_size: int = 16,
                   prefix_caching: bool = True, identity: int = 0) -> BlockConfig:
        """The blocks a KV budget holds; refused when it cannot hold one sequence of max_seq_len tokens."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        blocks = int(budget_bytes // (block_size * bytes_per_token))
        need = ceil_div(max_seq_len, block_size)
        if blocks < need:
            raise ValueError(f"a KV memory budget of {budget_bytes / 2**20:.2f} MB holds {blocks} blocks of "
                             f"{block_size} tokens ({bytes_per_token} bytes per token); one sequence of max_seq_len "
                             f"{max_seq_len} needs {need} ({need * block_size * bytes_per_token / 2**20:.2f} MB): "
                             f"raise kv_memory_mb or load with a smaller max_seq_len")
        return cls(blocks, block_size, prefix_caching, identity)


def chain_hashes(parent: int, tokens: list[int], size: int, start: int = 0) -> list[int]:
    """Hashes of the full `size`-token blocks of `tokens` from block `start`, each chained over the one
    before it (`parent`: block start-1's hash, or the engine identity for block 0)."""
    out = []
    for i in range(start, len(tokens) // size):
        parent = hash((parent, tuple(tokens[i * size:(i + 1) * size])))
        out.append(parent)
    return out


def chain_seed(config: BlockConfig, adapter: str | None) -> int:
    """The seed of a hash chain: the engine's identity, and the LoRA adapter the KV was computed under (so a
    prefix cached under one adapter is never reused under another, or under the base model)."""
    return config.identity if adapter is None else hash((config.identity, adapter))


def cached_chain(index: dict, identity: int, tokens: list[int], size: int) -> Iterator[tuple[int, tuple]]:
    """(chain hash, index entry) of each full block of `tokens` in order, while `index` holds it; an entry's
    last field is the block's tokens, compared too (a hash is not proof)."""
    parent = identity
    for i in range(len(tokens) // size):
        block = tuple(tokens[i * size:(i + 1) * size])
        parent = hash((parent, block))
        found = index.get(parent)
        if found is None or found[-1] != block:
            return
        yield parent, found


class BlockTable:
    """The blocks each of `rows` rows holds, the free block ids, and the index of full blocks by hash.

    `release_pages(row, start)` is called when a row's KV from token `start` on is no longer wanted (its pages
    go back to the OS)."""

    def __init__(self, config: BlockConfig, rows: int, max_seq_len: int, release_pages: Callable[..., None]):
        self.config, self.size = config, config.block_size
        self.num_blocks = config.num_blocks
        self.max_cached = (max_seq_len - 1) // self.size  # a decode call may write one dummy token past them
        self.free_ids: deque[int] = deque(range(config.num_blocks))
        self.rows: list[list[int]] = [[] for _ in range(rows)]
        self.hashes: list[list[int]] = [[] for _ in range(rows)]  # chain hash of each of a row's full blocks
        self.index: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # hash -> (row, block number, its tokens)
        self.copies: dict[int, int] = {}  # hash -> rows holding that block besides the one the index names
        self.lru: OrderedDict[int, None] = OrderedDict()  # released rows holding cached blocks, oldest first
        self._release_pages = release_pages

    # -- what the block manager reads out ----------------------------------------------------------
    def blocks(self, seq) -> list[int]:
        """The block ids of a running sequence, in token order (block i holds tokens i*size..)."""
        return list(self.rows[seq.slot])

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def cached_tokens(self, row: int) -> int:
        return len(self.hashes[row]) * self.size

    def evictable(self, keep: int = -1) -> int:
        return sum(len(self.rows[r]) for r in self.lru if r != keep)

    # -- hashing ---------------------------------------------------------------------------------
    def chain(self, tokens: list[int], start: int = 0, parent: int | None = None, adapter: str | None = None) -> list[int]:
        """Chain hashes of the full blocks of `tokens` from block `start` (`parent`: block start-1's)."""
        return chain_hashes(self.identity(adapter) if parent is None else parent, tokens, self.size, start)

    def identity(self, adapter: str | None) -> int:
        return chain_seed(self.config, adapter)

    def match(self, tokens: list[int], adapter: str | None = None) -> tuple[int, int]:
        """(row, n): some row holds the KV of the first n tokens of `tokens`, computed under `adapter` (n a
        multiple of the block size, the longest chain found); (-1, 0) when none."""
        row, n = -1, 0
        if self.config.prefix_caching:
            for i, (_, found) in enumerate(cached_chain(self.index, self.identity(adapter), tokens, self.size)):
                row, n = found[0], (i + 1) * self.size
        return row, n

    def register(self, row: int, tokens: list[int], adapter: str | None = None) -> None:
        """`tokens` (a prefix of what `row` holds, computed under LoRA `adapter`) are cached there: index its
        full blocks not yet indexed."""
        if not self.config.prefix_caching:
            return
        known = self.hashes[row]
        limit = min(len(tokens) // self.size, self.max_cached)
        if limit <= len(known):
            return
        new = self.chain(tokens[:limit * self.size], len(known), known[-1] if known else None, adapter)
        for i, h in enumerate(new, start=len(known)):
            if h in self.index:  # a copy (another row's prefix copied here): the index keeps the first
                self.copies[h] = self.copies.get(h, 0) + 1
            else:
                self.index[h] = (row, i, tuple(tokens[i * self.size:(i + 1) * self.size]))
        known.extend(new)

    # -- blocks ----------------------------------------------------------------------------------
    def reserve(self, row: int, tokens: int, keep: int = -1) -> bool:
        """Make `row` hold blocks for `tokens` tokens, evicting cached rows (least recently used first, never
        `keep`) as needed; False, with nothing taken, when the budget cannot hold them."""
        need = ceil_div(tokens, self.size) - len(self.rows[row])
        if need <= 0:
            return True
        if need > len(self.free_ids) + self.evictable(keep):
            return False
        while need > len(self.free_ids):
            self.shrink(next(r for r in self.lru if r != keep), need - len(self.free_ids))
        self.rows[row].extend(self.free_ids.popleft() for _ in range(need))
        return True

    def take(self, row: int, keep_tokens: int = 0) -> None:
        """A new sequence starts in `row`: keep its first `keep_tokens` cached tokens (a prefix the new
        sequence reuses in place), drop the rest."""
        self.lru.pop(row, None)
        self._trim(row, keep_tokens // self.size)
        if keep_tokens == 0:
            self._release_pages(row)

    def release(self, row: int) -> None:
        """The row's sequence is gone: its hashed blocks stay cached (most recently used), the rest are freed."""
        self._trim(row, len(self.hashes[row]))
        if self.rows[row]:
            self.lru[row] = None
        else:
            self._release_pages(row)

    def move(self, src: int, dst: int) -> None:
        """A running sequence's blocks go from row `src` to the empty row `dst` (its KV was copied there): the
        index finds its full blocks in `dst` from now on."""
        if self.rows[dst] or dst in self.lru:
            raise RuntimeError(f"KV row {dst} still holds blocks: a sequence moves only into an empty row")
        self.rows[dst], self.rows[src] = self.rows[src], []
        self.hashes[dst], self.hashes[src] = self.hashes[src], []
        for i, h in enumerate(self.hashes[dst]):
            found = self.index.get(h)
            if found is not None and found[:2] == (src, i):
                self.index[h] = (dst, i, found[2])
        self._release_pages(src)

    def touch(self, row: int) -> None:
        if row in self.lru:
            self.lru.move_to_end(row)

    def evict(self, row: int) -> None:
        """Forget a cached row: its blocks are free and its pages go back to the OS."""
        self.shrink(row, len(self.rows[row]))

    def shrink(self, row: int, blocks: int) -> None:
        """Evict the last `blocks` cached blocks of a released row, tail first, so its prefix (the part other
        prompts share most) stays cached; their pages go back to the OS. A row left with none leaves the LRU."""
        kept = max(len(self.rows[row]) - blocks, 0)
        self._trim(row, kept)
        if kept == 0:
            self.lru.pop(row, None)
        self._release_pages(row, kept * self.size)

    def _trim(self, row: int, blocks: int) -> None:
        dropped = self.hashes[row][blocks:]
        del self.hashes[row][blocks:]
        for i, h in enumerate(dropped, start=blocks):
            found = self.index[h]
            if not self.copies.get(h):
                del self.index[h]
                continue
            self.copies[h] -= 1
            if not self.copies[h]:
                del self.copies[h]
            if found[:2] == (row, i):  # a copy in another row stays findable there
                other = next(r for r in range(len(self.rows)) if r != row and self.hashes[r][i:i + 1] == [h])
                self.index[h] = (other, i, found[2])
        self.free_ids.extend(self.rows[row][blocks:])
        del self.rows[row][blocks:]
