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

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterator

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


@dataclass(frozen=True)
class Prefix:
    """The longest cached prefix of a prompt, as both block managers find it (`match`): the chain hashes and ids of
    its full blocks in token order, the `tokens` they hold, and the `row` that holds them (a BlockTable's: they are
    that row's first blocks; -1 in a BlockPool, whose blocks any row shares by reference)."""

    hashes: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    tokens: int = 0
    row: int = -1


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


class Blocks(ABC):
    """What both block managers keep: `num_blocks` blocks of `size` tokens, the free block ids, each of `rows` rows'
    block ids in token order (`rows`) and the chain hash of each of its full blocks (`hashes`), and `index`, the
    cached full blocks by chain hash (an entry's last field is the block's tokens). BlockTable (contiguous rows,
    accounting only) and BlockPool (runtime/batching/block_pool.py: a paged engine's device blocks) say how a
    block is held and shared (`register`, `_prefix`)."""

    def __init__(self, config: BlockConfig, rows: int):
        self.config, self.size, self.num_blocks = config, config.block_size, config.num_blocks
        self.free_ids: deque[int] = deque(range(config.num_blocks))
        self.rows: list[list[int]] = [[] for _ in range(rows)]
        self.hashes: list[list[int]] = [[] for _ in range(rows)]  # chain hash of each of a row's full blocks
        self.index: dict[int, tuple] = {}

    @property
    def used(self) -> int:
        """Blocks held or cached (what is not free)."""
        return self.num_blocks - len(self.free_ids)

    def cached_tokens(self, row: int) -> int:
        """Tokens of the row's full blocks that are indexed."""
        return len(self.hashes[row]) * self.size

    def match(self, tokens: list[int], adapter: str | None = None) -> Prefix:
        """The longest cached prefix of `tokens` (whole blocks) computed under LoRA `adapter` (None: the base
        model); Prefix() when none or prefix caching is off."""
        seed = chain_seed(self.config, adapter)
        chain = list(cached_chain(self.index, seed, tokens, self.size)) if self.config.prefix_caching else []
        return self._prefix(chain) if chain else Prefix()

    @abstractmethod
    def _prefix(self, chain: list[tuple[int, tuple]]) -> Prefix:
        """The Prefix of a found chain of (chain hash, index entry)."""

    @abstractmethod
    def register(self, row: int, tokens: list[int], adapter: str | None = None) -> None:
        """`tokens` (a prefix of what `row` holds, computed under LoRA `adapter`) are computed: index its full
        blocks not yet indexed."""

    @abstractmethod
    def reserve(self, row: int, tokens: int) -> bool:
        """Make `row` hold blocks for `tokens` tokens; False, with nothing taken, when the budget cannot hold them."""

    @abstractmethod
    def release(self, row: int) -> None:
        """The row's sequence is gone: its blocks are given back (full indexed ones stay cached)."""

    def _hash_new_blocks(self, row: int, tokens: list[int], limit: int,
                         adapter: str | None = None) -> list[tuple[int, int]]:
        """(block number, chain hash) of the row's full blocks among the first `limit` blocks of `tokens` (a prefix of
        what the row holds) that are not hashed yet, now in `hashes[row]`; none with prefix caching off."""
        known = self.hashes[row]
        if not self.config.prefix_caching or limit <= len(known):
            return []
        start = len(known)
        new = chain_hashes(known[-1] if known else chain_seed(self.config, adapter), tokens[:limit * self.size],
                           self.size, start)
        known.extend(new)
        return list(enumerate(new, start=start))


class BlockTable(Blocks):
    """The blocks each of `rows` contiguous rows holds (Blocks): accounting only, it touches no KV memory. Where a
    row's KV from a token on is no longer wanted, it says so in `dropped` ((row, token) pairs, in order): the
    contiguous KV table (runtime/batching/slot_table.py) takes them after each call (`take_dropped`) and hands
    those pages back to the OS itself."""

    def __init__(self, config: BlockConfig, rows: int, max_seq_len: int):
        super().__init__(config, rows)
        self.max_cached = (max_seq_len - 1) // self.size  # a decode call may write one dummy token past them
        self.index: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # hash -> (row, block number, its tokens)
        self.copies: dict[int, int] = {}  # hash -> rows holding that block besides the one the index names
        self.lru: OrderedDict[int, None] = OrderedDict()  # released rows holding cached blocks, oldest first
        self.dropped: list[tuple[int, int]] = []  # (row, token): the row's KV from that token on is not wanted

    # -- what the block manager reads out ----------------------------------------------------------
    def blocks(self, seq) -> list[int]:
        """The block ids of a running sequence, in token order (block i holds tokens i*size..)."""
        return list(self.rows[seq.slot])

    def evictable(self, keep: int = -1) -> int:
        return sum(len(self.rows[r]) for r in self.lru if r != keep)

    # -- hashing ---------------------------------------------------------------------------------
    def _prefix(self, chain: list[tuple[int, tuple]]) -> Prefix:
        """The row holding the prefix (the row of its last block holds every block before it too, the hashes being
        chained) and that row's blocks for it."""
        row = chain[-1][1][0]
        return Prefix([h for h, _ in chain], self.rows[row][:len(chain)], len(chain) * self.size, row)

    def register(self, row: int, tokens: list[int], adapter: str | None = None) -> None:
        """`tokens` (a prefix of what `row` holds, computed under LoRA `adapter`) are cached there: index its full blocks not yet indexed."""
        for i, h in self._hash_new_blocks(row, tokens, min(len(tokens) // self.size, self.max_cached), adapter):
            if h in self.index:  # a copy (another row's prefix copied here): the index keeps the first
                self.copies[h] = self.copies.get(h, 0) + 1
            else:
                self.index[h] = (row, i, tuple(tokens[i * self.size:(i + 1) * self.size]))

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
            self.dropped.append((row, 0))

    def release(self, row: int) -> None:
        """The row's sequence is gone: its hashed blocks stay cached (most recently used), the rest are freed."""
        self._trim(row, len(self.hashes[row]))
        if self.rows[row]:
            self.lru[row] = None
        else:
            self.dropped.append((row, 0))

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
        self.dropped.append((src, 0))

    def take_dropped(self) -> list[tuple[int, int]]:
        """The (row, token) pairs dropped since the last call, in order: each row's KV from that token on."""
        dropped, self.dropped = self.dropped, []
        return dropped

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
        self.dropped.append((row, kept * self.size))

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
