"""runtime/model/paged_inputs.py against a numpy reference of PagedAttention: new K/V scattered into a
block pool through slot_mapping, then each sequence's blocks gathered through block_table and attended
causally must equal dense attention over the same sequence's contiguous KV."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.model.paged_inputs import UNMAPPED, paged_inputs

HEADS, KV_HEADS, DIM = 4, 2, 8


def paged_attention(q, k, v, key_cache, value_cache, inputs, block_size):
    """Reference PagedAttention (no rotary): q [tokens, heads, dim], k/v [tokens, kv_heads, dim]; the caches
    [num_blocks, block_size, kv_heads, dim] are updated in place. Returns [tokens, heads, dim]."""
    flat_k = key_cache.reshape(-1, KV_HEADS, DIM)
    flat_v = value_cache.reshape(-1, KV_HEADS, DIM)
    write = inputs.slot_mapping != UNMAPPED
    flat_k[inputs.slot_mapping[write]], flat_v[inputs.slot_mapping[write]] = k[write], v[write]
    out = np.zeros_like(q)
    cum = inputs.cumulative_sequence_length
    for i, past in enumerate(inputs.past_seqlens):
        total = past + cum[i + 1] - cum[i]
        positions = np.arange(total)
        slots = inputs.block_table[i, positions // block_size] * block_size + positions % block_size
        out[cum[i]:cum[i + 1]] = dense_attention(q[cum[i]:cum[i + 1]], flat_k[slots], flat_v[slots])
    return out


def dense_attention(q, keys, values):
    """Causal GQA of the last len(q) positions over keys/values [total, kv_heads, dim]."""
    total, new = len(keys), len(q)
    group = HEADS // KV_HEADS
    scores = np.einsum("qhd,khd->hqk", q, np.repeat(keys, group, axis=1)) / np.sqrt(DIM)
    visible = np.arange(total)[None, :] <= (total - new + np.arange(new))[:, None]
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, np.repeat(values, group, axis=1))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_gathered_blocks_equal_dense_attention(block_size):
    """A mixed step: a first prompt, a chunked prefill on a past, two decodes; block ids shuffled in the pool."""
    rng = np.random.default_rng(block_size)
    past, new = [0, 13, 7, 31], [9, 5, 1, 1]
    totals = [p + n for p, n in zip(past, new)]
    needs = [-(-t // block_size) for t in totals]
    pool = rng.permutation(sum(needs) + 3)  # 3 blocks nobody holds
    blocks = np.split(pool[:sum(needs)], np.cumsum(needs)[:-1])
    dense_k = [rng.standard_normal((t, KV_HEADS, DIM)) for t in totals]
    dense_v = [rng.standard_normal((t, KV_HEADS, DIM)) for t in totals]
    key_cache = np.full((len(pool), block_size, KV_HEADS, DIM), np.nan)  # unwritten slots poison the result
    value_cache = key_cache.copy()
    for ids, p, dk, dv in zip(blocks, past, dense_k, dense_v):  # the past already in the pool
        slots = ids[np.arange(p) // block_size] * block_size + np.arange(p) % block_size
        key_cache.reshape(-1, KV_HEADS, DIM)[slots] = dk[:p]
        value_cache.reshape(-1, KV_HEADS, DIM)[slots] = dv[:p]
    inputs = paged_inputs([b.tolist() for b in blocks], past, new, block_size, max_blocks=max(needs) + 2)
    q = rng.standard_normal((inputs.num_tokens, HEADS, DIM))
    k = np.concatenate([dk[p:] for dk, p in zip(dense_k, past)])
    v = np.concatenate([dv[p:] for dv, p in zip(dense_v, past)])
    out = paged_attention(q, k, v, key_cache, value_cache, inputs, block_size)
    cum = inputs.cumulative_sequence_length
    for i in range(len(blocks)):
        np.testing.assert_allclose(out[cum[i]:cum[i + 1]], dense_attention(q[cum[i]:cum[i + 1]], dense_k[i], dense_v[i]),
                                   atol=1e-12)
    assert inputs.block_table.shape == (4, max(needs) + 2) and (inputs.block_table[:, -2:] == UNMAPPED).all()
    assert inputs.attention_metadata.tolist() == [9, 32]


def test_slot_mapping_layout_and_skipped_writes():
    """Slots follow the block ids; a skipped token (a shared cached block, a rejected draft) writes nothing."""
    inputs = paged_inputs([[7, 2], [5]], past_lens=[3, 0], new_tokens=[3, 2], block_size=4,
                          skip_writes=[[2], []])
    assert inputs.cumulative_sequence_length.tolist() == [0, 3, 5]
    assert inputs.past_seqlens.tolist() == [3, 0]
    assert inputs.block_table.tolist() == [[7, 2], [5, UNMAPPED]]
    # sequence 0: positions 3, 4, 5 -> block 7 offset 3, block 2 offsets 0 and 1 (the last skipped)
    assert inputs.slot_mapping.tolist() == [31, 8, UNMAPPED, 20, 21]
    assert all(a.dtype == np.int32 for a in inputs.feeds().values())
    key_cache = np.zeros((8, 4, KV_HEADS, DIM))
    before = key_cache.copy()
    paged_attention(np.ones((5, HEADS, DIM)), np.ones((5, KV_HEADS, DIM)), np.ones((5, KV_HEADS, DIM)),
                    key_cache, np.zeros_like(key_cache), inputs, 4)
    changed = {int(s) for s in np.flatnonzero((key_cache != before).any(axis=(2, 3)).reshape(-1))}
    assert changed == {31, 8, 20, 21}


@pytest.mark.parametrize("blocks, past, new, problem", [
    ([[0]], [3], [2], "need 2 blocks"),
    ([[0, 0]], [3], [2], "distinct"),
    ([[0, -1]], [3], [2], "distinct and >= 0"),
    ([[0], [1]], [0], [1, 1], "one entry per sequence"),
    ([[0]], [0], [-1], ">= 0"),
])
def test_bad_input_is_named(blocks, past, new, problem):
    with pytest.raises(ValueError, match=problem):
        paged_inputs(blocks, past, new, block_size=4)


def test_skip_writes_out_of_range():
    with pytest.raises(ValueError, match="skip_writes"):
        paged_inputs([[0]], [0], [2], block_size=4, skip_writes=[[2]])
