"""The build pipeline: every pass the builder runs, in order, in one literal list."""
from __future__ import annotations

from builder.pass_manager import Disabled, Phase
from builder.passes.add_block_minimums import AddBlockMinimums
from builder.passes.add_lora import AddLoRA
from builder.passes.append_hidden_output import AppendHiddenOutput
from builder.passes.append_sampling_head import AppendSamplingHead
from builder.passes.calibrate_kv_scales import CalibrateKVScales
from builder.passes.fold_rotary import FoldRotary
from builder.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from builder.passes.fuse_gate_up import FuseGateUp
from builder.passes.fuse_qkv import FuseQKV
from builder.passes.permute_activations import PermuteActivations
from builder.passes.plan_cuda_graphs import PlanCudaGraphs
from builder.passes.plan_kv_cache import PlanKVCache
from builder.passes.quantize_weights import QuantizeWeights
from builder.passes.search_awq_scales import SearchAWQScales
from builder.passes.solve_gptq import SolveGPTQ
from builder.passes.shard_tensor_parallel import ShardTensorParallel
from builder.passes.remove_dead_nodes import RemoveDeadNodes
from builder.quant.schemes import SCHEMES
from builder.gguf.checkpoint import import_format  # GGUF-staged or Hugging Face
from builder.recipe import Recipe
from builder.spec import linear_modules


def pipeline(recipe: Recipe, rank: int = 0) -> list[Phase]:
    """The phases and passes for one recipe (and tensor-parallel rank). Switched-off passes stay listed as
    no-ops."""
    on = recipe.passes
    limits = recipe.limits
    quant = recipe.quantization
    tp = recipe.parallel.tensor_parallel
    kv = recipe.kv_cache
    return [
        # Operator fusion: rewrite HF-shaped ops into the fused kernels of the target.
        Phase("fusion", [
            FoldRotary(),
            # A GPTQ desc_act checkpoint's linears read their input in the order their groups are stored.
            PermuteActivations(),
            FuseQKV() if on.fuse_qkv else Disabled("fuse_qkv", "passes.fuse_qkv is false"),
            FuseGateUp() if on.fuse_gate_up else Disabled("fuse_gate_up", "passes.fuse_gate_up is false"),
            FuseAddRMSNorm() if on.fuse_add_rmsnorm else Disabled("fuse_add_rmsnorm", "passes.fuse_add_rmsnorm is false"),
            # Output head: ArgMax / TopK over the logits (recipe section `sampling_head:`).
            AppendSamplingHead(recipe.sampling_head.max_top_k) if recipe.sampling_head.enabled
            else Disabled("append_sampling_head", "sampling_head.enabled is false"),
            # The last hidden state as an output for an EAGLE draft head (recipe `speculative: {draft_model: HEAD}`).
            AppendHiddenOutput() if recipe.speculative.eagle
            else Disabled("append_hidden_output", "speculative.draft_model is not an EAGLE head"),
        ]),
        # Multi-LoRA (recipe section `lora:`): adapter inputs on the fused linears, before quantization.
        Phase("adapters", [
            AddLoRA(recipe.lora.max_rank, recipe.lora.max_adapters, recipe.lora.targets, linear_modules) if recipe.lora.enabled
            else Disabled("add_lora", "lora.max_adapters is 0"),
        ]),
        # Tensor parallelism (recipe section `parallel:`): keep this rank's shard, after fusion and before
        # quantization so that each shard is quantized on its own.
        Phase("parallel", [
            ShardTensorParallel(tp, rank) if tp > 1 else Disabled("shard_tensor_parallel",
                                                                  "parallel.tensor_parallel is 1"),
        ]),
        # Weight quantization (recipe section `quantization:`). AWQ first folds activation-aware
        # scales into the float weights, GPTQ solves the integer weights layer by layer, then
        # Linear -> QuantLinear.
        Phase("quantization", [
            SearchAWQScales(recipe.model, quant) if quant.mode != "none" and SCHEMES[quant.mode].awq
            else Disabled("search_awq_scales", f"quantization.mode {quant.mode} has no activation-aware scales"),
            SolveGPTQ(recipe.model, quant) if quant.mode != "none" and SCHEMES[quant.mode].gptq
            else Disabled("solve_gptq", f"quantization.mode {quant.mode} is not GPTQ"),
            QuantizeWeights(quant, recipe.target.device) if quant.mode != "none" or import_format(recipe.model)
            else Disabled("quantize_weights", "quantization.mode is none"),
            # A GGUF weight with a float minimum per block: + (x summed per block) @ minimums.
            AddBlockMinimums(),
        ]),
        # Static KV-cache layout (recipe sections `limits:`, `kv_cache:`; an int8 cache's static scales) and
        # CUDA-graph decode buckets (recipe section `cuda_graphs:`).
        Phase("layout", [
            PlanKVCache(limits.max_batch_size, limits.max_seq_len, recipe.target.dtype,
                        limits.kv_memory_budget_mb, storage=None if kv.dtype == "float" else kv.dtype,
                        block_size=kv.block_size if recipe.target.attention == "paged" else None),
            CalibrateKVScales(recipe.model, kv.calibration) if kv.dtype == "int8"
            else Disabled("calibrate_kv_scales", "kv_cache.dtype is float"),
            PlanCudaGraphs(recipe.cuda_graphs.batch_sizes, limits.max_batch_size) if recipe.cuda_graphs.enabled
            else Disabled("plan_cuda_graphs", "cuda_graphs.enabled is false"),
        ]),
        Phase("cleanup", [
            RemoveDeadNodes(),
        ]),
    ]
