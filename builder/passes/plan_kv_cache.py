"""PlanKVCache: compute the static KV layout (KVCacheSpec) from the attention nodes and the
recipe's limits, fit it to the optional memory budget, and record it in graph.meta."""
from __future__ import annotations

from builder.ir import Graph
from builder.pass_manager import Pass
from runtime.kv_spec import KVCacheSpec


class PlanError(ValueError):
    """The limits cannot be met by this model or memory budget."""


class PlanKVCache(Pass):
    name = "plan_kv_cache"

    def __init__(self, max_batch_size: int, max_seq_len: int, dtype: str, memory_budget_mb: float | None = None):
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.dtype, self.budget = dtype, memory_budget_mb

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        attention = list(g.nodes_of("Attention"))
        if not attention:
            raise PlanError("the graph has no Attention node to plan a KV cache for")
        shapes = {(n.attrs["kv_heads"], n.attrs["head_dim"]) for n in attention}
        if len(shapes) != 1:
            raise PlanError(f"attention layers disagree on (kv_heads, head_dim): {sorted(shapes)}")
        layers = sorted(n.attrs["layer"] for n in attention)
        if layers != list(range(len(attention))):
            raise PlanError(f"attention layer indices must be 0..{len(attention) - 1}, got {layers}")
        windows = {n.attrs.get("window") for n in attention}
        self._check_length(g.meta.get("hyperparameters", {}), windows != {None}, g.meta.get("rope", {}))
        (kv_heads, head_dim), = shapes
        spec = KVCacheSpec(len(attention), kv_heads, head_dim, self.dtype, self.max_batch_size, self.max_seq_len,
                           sliding_window=None if None in windows else max(windows))
        g.meta["kv_cache"] = self._fit(spec)
        return g

    def _check_length(self, hp: dict, honoured: bool, rope: dict) -> None:
        window = hp.get("sliding_window")
        if window is not None and not honoured and self.max_seq_len > window:
            raise PlanError(f"max_seq_len {self.max_seq_len} exceeds the model's sliding window {window}, "
                            f"and no attention node honours the window; use max_seq_len <= {window}")
        exact = rope.get("exact_up_to")
        if exact is not None and self.max_seq_len > exact:
            raise PlanError(f"max_seq_len {self.max_seq_len} exceeds original_max_position_embeddings {exact}: "
                            f"past it longrope switches to its long factors, which the engine's fixed rotary "
                            f"tables do not follow; use max_seq_len <= {exact}")
        longest = hp.get("max_position_embeddings")
        if longest is not None and self.max_seq_len > longest:
            raise PlanError(f"max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                            f"{longest}; use max_seq_len <= {longest}")

    def _fit(self, spec: KVCacheSpec) -> KVCacheSpec:
        if self.budget is None:
            return spec
        slots = int(self.budget * 2**20 // spec.bytes_per_slot)
        if slots < 1:
            raise PlanError(f"kv_memory_budget_mb {self.budget} holds no sequence of max_seq_len "
                            f"{spec.max_seq_len} ({spec.bytes_per_slot / 2**20:.1f} MiB per slot needed)")
        return spec.resized(slots=min(slots, spec.slots))
