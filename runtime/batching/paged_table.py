"""The paged table: the KV table (runtime/batching/kv_table.py) of a paged engine (PagedAttention, CUDA). Its
blocks are the device pool's (runtime/batching/block_pool.py), so a row holds no memory, only a sequence's place
in the step; a cached prefix is shared by reference from wherever it is, never copied, and one packed call runs
exactly the step's rows, decode rows and prompt chunks together (runtime/batching/decode.py `PackedCall`), each
with its block table (`PagedRow`): nothing rides along, nothing needs compacting."""
from __future__ import annotations

from runtime.manifest.arith import ceil_div
from runtime.batching.block_pool import BlockPool
from runtime.batching.block_table import Prefix
from runtime.batching.decode import PackedCall, head_for
from runtime.batching.kv_table import KVTable
from runtime.model.paged_inputs import PagedRow
from runtime.request.sequence import Sequence


class PagedTable(KVTable):
    """A KVTable over a paged engine's BlockPool, whose block ids index `cache`'s pools."""

    def __init__(self, cache, blocks: BlockPool, mirrors: tuple = ()):
        if blocks.size != cache.spec.block_size or blocks.num_blocks > cache.num_blocks:
            raise ValueError(f"a block pool of {blocks.num_blocks} blocks of {blocks.size} tokens does not fit this "
                             f"paged cache: {cache.num_blocks} blocks of {cache.spec.block_size} tokens")
        super().__init__(cache, blocks, mirrors)

    def admit(self, seq: Sequence, min_reuse: int, chunk: int, watermark: int = 0) -> bool:
        """Give `seq` a row whose table starts with the cached blocks its prefill matches (shared; a
        whole-prompt match still computes the last token, for its logits, without writing its KV) and blocks
        for its first `chunk` tokens past them; False, changing nothing, when they (and `watermark` spare
        blocks) do not fit."""
        ids = seq.prefill_ids
        shared = self.blocks.match(ids, seq.params.adapter)
        if shared.tokens < min_reuse:
            shared = Prefix()
        tokens = min(len(ids), shared.tokens + chunk)  # never fewer than the shared blocks hold
        if ceil_div(tokens, self.blocks.size) - len(shared.blocks) + watermark > self.blocks.available(shared.blocks):
            return False
        slot = min(self.free)
        self.blocks.share(slot, shared)
        self.blocks.reserve(slot, tokens)
        self._seat(seq, slot, min(shared.tokens, len(ids) - 1))
        return True

    def place(self, seq: Sequence) -> PagedRow:
        """A copy of the sequence's block ids now (covering the tokens the scheduler reserved for it: a call made
        now may run while the table changes, as steps run ahead do) and what its shared blocks hold."""
        return PagedRow(list(seq.blocks), self.blocks.present[seq.slot])

    def calls(self, runner, decode: list[Sequence], prefill: list[tuple[Sequence, int]]) -> list:
        """One packed call over the decode rows and the prompt chunks."""
        seqs = decode + [seq for seq, _ in prefill]
        if not seqs:
            return []
        new = [[s.token(s.num_cached)] for s in decode] + [s.prefill_ids[s.num_cached:s.num_cached + n] for s, n in prefill]
        return [PackedCall(seqs, [self.place(s) for s in seqs], [s.num_cached for s in seqs], new, len(prefill),
                           head_for(runner, decode) if not prefill else "logits")]
