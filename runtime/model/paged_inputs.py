"""The per-step inputs of a PagedAttention engine (ONNX Runtime's com.microsoft PagedAttention, CUDA only),
from what the block manager knows: each sequence's block ids (`Sequence.blocks`, from runtime/batching/block_pool.py,
handed to the runner in a `PagedRow`), its past length and the number of new tokens it brings this step.

The KV cache is a pool of blocks, key_cache / value_cache [num_blocks, block_size, kv_heads, head_dim];
token t of a sequence lives in block blocks[t // block_size] at offset t % block_size, that is at flat
slot blocks[t // block_size] * block_size + t % block_size. New tokens of all sequences are packed, no
padding: sequence i's are rows cumulative_sequence_length[i] .. [i + 1] of query/key/value."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from runtime.manifest.arith import ceil_div

UNMAPPED = -1  # block_table: no block; slot_mapping: do not write this token's KV


@dataclass(frozen=True, slots=True)
class PagedRow:
    """Where one sequence's KV is in a paged engine's pool, what a call needs of it: its block ids in token order
    and `present`, how many of its first tokens' KV its shared cached blocks already hold (not written again)."""

    blocks: Sequence[int]
    present: int = 0


@dataclass(frozen=True)
class PagedInputs:
    """One step's PagedAttention inputs, named as the op names them (int32 throughout)."""

    cumulative_sequence_length: np.ndarray  # [batch + 1]: new-token offsets of the packed rows
    past_seqlens: np.ndarray                # [batch]: tokens already in the cache per sequence
    block_table: np.ndarray                 # [batch, max_blocks_per_sequence], UNMAPPED past a sequence's blocks
    slot_mapping: np.ndarray                # [num_tokens]: flat cache slot each new token's K/V goes to, or UNMAPPED
    attention_metadata: np.ndarray          # [2] host: (longest new-token run, longest past + new) this step

    @property
    def num_tokens(self) -> int:
        return int(self.cumulative_sequence_length[-1])

    def feeds(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in ("cumulative_sequence_length", "past_seqlens", "block_table",
                                                        "slot_mapping", "attention_metadata")}


def paged_inputs(blocks: Sequence[Sequence[int]], past_lens: Sequence[int], new_tokens: Sequence[int],
                 block_size: int, max_blocks: int | None = None,
                 skip_writes: Sequence[Iterable[int]] | None = None) -> PagedInputs:
    """PagedAttention's inputs for a packed step over len(blocks) sequences.

    blocks[i]: sequence i's block ids in token order, covering at least past_lens[i] + new_tokens[i]
    tokens; `max_blocks` pads the block table's width (a fixed shape for CUDA-graph replay; default the
    widest sequence). skip_writes[i]: indices among sequence i's new tokens whose K/V is not written
    (slot UNMAPPED): tokens of a cached prefix block shared by reference, or rejected draft tokens."""
    batch = len(blocks)
    if not len(past_lens) == len(new_tokens) == batch:
        raise ValueError(f"blocks, past_lens and new_tokens must have one entry per sequence; got "
                         f"{batch}, {len(past_lens)}, {len(new_tokens)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    past, new = np.asarray(past_lens, np.int64), np.asarray(new_tokens, np.int64)
    if batch and (past.min() < 0 or new.min() < 0):
        raise ValueError(f"past_lens and new_tokens must be >= 0, got {past.tolist()} and {new.tolist()}")
    width = max([len(b) for b in blocks], default=0) if max_blocks is None else max_blocks
    table = np.full((batch, width), UNMAPPED, np.int32)
    slots = []
    for i, ids in enumerate(blocks):
        _check_blocks(i, ids, int(past[i] + new[i]), block_size, width)
        table[i, :len(ids)] = ids
        positions = np.arange(past[i], past[i] + new[i])
        row = table[i, positions // block_size].astype(np.int64) * block_size + positions % block_size
        skipped = list(skip_writes[i]) if skip_writes is not None else []
        if any(not 0 <= k < new[i] for k in skipped):
            raise ValueError(f"sequence {i}: skip_writes {skipped} must index its {new[i]} new tokens")
        row[skipped] = UNMAPPED
        slots.append(row)
    cumulative = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    metadata = np.array([new.max(initial=0), (past + new).max(initial=0)], np.int32)
    return PagedInputs(cumulative, past.astype(np.int32), table,
                       np.concatenate(slots or [np.zeros(0)]).astype(np.int32), metadata)


def _check_blocks(i: int, ids: Sequence[int], total: int, block_size: int, width: int) -> None:
    need = ceil_div(total, block_size)
    if len(ids) < need:
        raise ValueError(f"sequence {i}: {total} tokens need {need} blocks of {block_size}, it holds {len(ids)}")
    if len(ids) > width:
        raise ValueError(f"sequence {i} holds {len(ids)} blocks, more than max_blocks {width}")
    if any(b < 0 for b in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"sequence {i}: block ids must be distinct and >= 0, got {list(ids)}")
