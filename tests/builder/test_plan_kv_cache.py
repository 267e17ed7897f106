"""plan_kv_cache: slots and bytes, the memory budget, limits against the model's caps, errors.

Split from the former tests/test_ir_and_passes.py; graphs and the numpy interpreter of the IR
are in tests/graph_helpers.py."""
from __future__ import annotations

import pytest

from builder.passes.plan_kv_cache import PlanError, PlanKVCache
from runtime.manifest.kv_spec import KVCacheSpec
from graph_helpers import F32, HEAD_DIM, KV_HEADS, decoder, mlp_block, ops


BYTES_PER_SLOT_F32 = 2 * 2 * KV_HEADS * 64 * HEAD_DIM * 4  # K and V, 2 layers, max_seq_len 64


def test_plan_kv_cache_computes_slots_and_bytes():
    g = decoder()
    after = PlanKVCache(max_batch_size=4, max_seq_len=64, dtype=F32).run(g)
    spec = after.meta.kv_cache
    assert spec == KVCacheSpec(num_layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=F32, slots=4,
                               max_seq_len=64)
    assert spec.buffer_shape == (4, KV_HEADS, 64, HEAD_DIM)
    assert spec.bytes_per_slot == BYTES_PER_SLOT_F32 and spec.bytes == 4 * BYTES_PER_SLOT_F32
    assert spec.to_dict()["bytes"] == spec.bytes
    assert g.meta.kv_cache is None  # planned on a copy
    half = PlanKVCache(4, 64, "float16").run(g).meta.kv_cache
    assert half.dtype == "float16" and half.bytes == spec.bytes // 2
    assert ops(after) == ops(g)


@pytest.mark.parametrize("budget_slots, expected", [(2, 2), (2.5, 2), (4, 4), (100, 4)])
def test_plan_kv_cache_fits_memory_budget(budget_slots, expected):
    budget_mb = budget_slots * BYTES_PER_SLOT_F32 / 2**20
    spec = PlanKVCache(4, 64, F32, memory_budget_mb=budget_mb).run(decoder()).meta.kv_cache
    assert spec.slots == expected and spec.max_seq_len == 64
    assert spec.bytes <= budget_mb * 2**20


def test_plan_kv_cache_budget_without_a_slot_is_an_error():
    budget_mb = 0.5 * BYTES_PER_SLOT_F32 / 2**20
    with pytest.raises(PlanError, match=f"kv_memory_budget_mb {budget_mb} holds no sequence of max_seq_len 64"):
        PlanKVCache(4, 64, F32, memory_budget_mb=budget_mb).run(decoder())
    with pytest.raises(PlanError, match="holds no sequence"):
        PlanKVCache(4, 64, F32, memory_budget_mb=0).run(decoder())


@pytest.mark.parametrize("hp, message", [
    ({"sliding_window": 32}, "max_seq_len 64 exceeds the model's sliding window 32.*use max_seq_len <= 32"),
    ({"max_position_embeddings": 48}, "max_seq_len 64 exceeds the model's max_position_embeddings 48.*<= 48"),
    ({"sliding_window": 100, "max_position_embeddings": 48}, "max_position_embeddings 48"),
])
def test_plan_kv_cache_refuses_too_long_max_seq_len(hp, message):
    g = decoder()
    g.meta.hyperparameters = hp
    with pytest.raises(PlanError, match=message):
        PlanKVCache(4, 64, F32).run(g)


def test_plan_kv_cache_accepts_limits_equal_to_model_caps():
    g = decoder()
    g.meta.hyperparameters = {"sliding_window": 64, "max_position_embeddings": 64}
    assert PlanKVCache(4, 64, F32).run(g).meta.kv_cache.max_seq_len == 64
    g.meta.hyperparameters = {}
    assert PlanKVCache(4, 64, F32).run(g).meta.kv_cache.max_seq_len == 64


def test_plan_kv_cache_structural_errors():
    g, _ = mlp_block()
    with pytest.raises(PlanError, match="no Attention node"):
        PlanKVCache(1, 8, F32).run(g)
    g = decoder()
    list(g.nodes_of("Attention"))[1].attrs["kv_heads"] = 1
    with pytest.raises(PlanError, match="disagree on \\(kv_heads, head_dim\\)"):
        PlanKVCache(1, 8, F32).run(g)
    g = decoder()
    list(g.nodes_of("Attention"))[1].attrs["layer"] = 5
    with pytest.raises(PlanError, match=r"must be 0..1, got \[0, 5\]"):
        PlanKVCache(1, 8, F32).run(g)
