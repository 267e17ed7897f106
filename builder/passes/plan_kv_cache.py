"""PlanKVCache: compute the static KV layout (KVCacheSpec) from the attention nodes and the
recipe's limits and KV storage (float, or int8 codes: recipe `kv_cache.dtype`; a block pool of
`block_size` token blocks for a paged engine), fit it to the optional memory budget, and record it in
graph.meta."""
from __future__ import annotations

from builder.ir import Graph
from builder.pass_manager import Pass
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.types import Rope


class PlanError(ValueError):
    """The limits cannot be met by this model or memory budget."""


class PlanKVCache(Pass):
    name = "plan_kv_cache"

    def __init__(self, max_batch_size: int, max_seq_len: int, dtype: str, memory_budget_mb: float | None = None,
                 storage: str | None = None, block_size: int | None = None):
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.dtype, self.budget, self.storage, self.block_size = dtype, memory_budget_mb, storage, block_size

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
        limits = self._length_limits(g.meta.hyperparameters, windows != {None}, g.meta.rope)
        for limit, why in limits:
            if self.max_seq_len > limit:
                raise PlanError(f"max_seq_len {self.max_seq_len} exceeds {why}; use max_seq_len <= {limit}")
        # the longest sequence the model serves exactly: the runtime may raise max_seq_len up to it at load
        g.meta.max_seq_len_cap = min((limit for limit, _ in limits), default=self.max_seq_len)
        (kv_heads, head_dim), = shapes
        spec = KVCacheSpec(len(attention), kv_heads, head_dim, self.dtype, self.max_batch_size, self.max_seq_len,
                           sliding_window=None if None in windows else max(windows), storage=self.storage,
                           block_size=self.block_size)
        g.meta.kv_cache = self._fit(spec)
        return g

    @staticmethod
    def _length_limits(hp: dict, honoured: bool, rope: Rope | None) -> list[tuple[int, str]]:
        """(limit, reason) for every bound on the sequence length this model is exact up to."""
        limits = []
        window = hp.get("sliding_window")
        if window is not None and not honoured:
            limits.append((window, f"the model's sliding window {window}, and no attention node honours the window"))
        exact = rope.exact_up_to if rope is not None else None
        if exact is not None:
            limits.append((exact, f"original_max_position_embeddings {exact}: past it longrope switches to its "
                                  f"long factors, which the engine's fixed rotary tables do not follow"))
        longest = hp.get("max_position_embeddings")
        if longest is not None:
            limits.append((longest, f"the model's max_position_embeddings {longest}"))
        return limits

    def _fit(self, spec: KVCacheSpec) -> KVCacheSpec:
        if self.budget is None:
            return spec
        slots = int(self.budget * 2**20 // spec.bytes_per_slot)
        if slots < 1:
            raise PlanError(f"kv_memory_budget_mb {self.budget} holds no sequence of max_seq_len "
                            f"{spec.max_seq_len} ({spec.bytes_per_slot / 2**20:.1f} MiB per slot needed)")
        return spec.resized(slots=min(slots, spec.slots))
