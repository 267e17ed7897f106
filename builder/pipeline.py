"""The build pipeline: every pass the builder runs, in order, in one literal list."""
from __future__ import annotations

from builder.pass_manager import Disabled, Phase
from builder.passes.fold_rotary import FoldRotary
from builder.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from builder.passes.fuse_gate_up import FuseGateUp
from builder.passes.fuse_qkv import FuseQKV
from builder.passes.plan_kv_cache import PlanKVCache
from builder.passes.remove_dead_nodes import RemoveDeadNodes
from builder.recipe import Recipe


def pipeline(recipe: Recipe) -> list[Phase]:
    """The phases and passes for one recipe. Switched-off passes stay listed as no-ops."""
    on = recipe.passes
    limits = recipe.limits
    return [
        # Operator fusion: rewrite HF-shaped ops into the fused kernels of the target.
        Phase("fusion", [
            FoldRotary(),
            FuseQKV() if on.fuse_qkv else Disabled("fuse_qkv"),
            FuseGateUp() if on.fuse_gate_up else Disabled("fuse_gate_up"),
            FuseAddRMSNorm() if on.fuse_add_rmsnorm else Disabled("fuse_add_rmsnorm"),
        ]),
        # Weight quantization (recipe section `quantization:`).
        Phase("quantization", [
            Disabled("quantize_weights", "quantization.mode is none"),
        ]),
        # Static KV-cache layout for the runtime.
        Phase("layout", [
            PlanKVCache(limits.max_batch_size, limits.max_seq_len, recipe.target.dtype,
                        limits.kv_memory_budget_mb),
        ]),
        Phase("cleanup", [
            RemoveDeadNodes(),
        ]),
    ]
