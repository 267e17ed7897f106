"""PlanCudaGraphs: record the decode batch buckets a CUDA runtime captures one graph each for."""
from __future__ import annotations

from builder.ir import Graph
from builder.pass_manager import Pass
from runtime.manifest.types import CudaGraphs


class PlanCudaGraphs(Pass):
    """graph.meta.cuda_graphs = CudaGraphs(enabled=True, batch_sizes=sorted buckets): the recipe's sizes
    up to the planned batch limit (the KV plan's slots when planned, else `max_batch_size`), plus that
    limit itself, so every decode batch pads up to some bucket."""

    name = "plan_cuda_graphs"

    def __init__(self, batch_sizes: list[int], max_batch_size: int):
        self.batch_sizes, self.max_batch_size = list(batch_sizes), max_batch_size

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        kv = g.meta.kv_cache
        limit = min(self.max_batch_size, kv.slots) if kv is not None else self.max_batch_size
        buckets = sorted({size for size in self.batch_sizes if size <= limit} | {limit})
        g.meta.cuda_graphs = CudaGraphs(enabled=True, batch_sizes=tuple(buckets))
        return g
