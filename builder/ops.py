"""The IR's operator set: arity and required attributes of each op, checked by the verifier."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSchema:
    """`inputs` names the operands; a trailing `?` marks an optional one. An output named with a trailing `*`
    stands for one or more (Split's parts)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[str, ...] = ()
    doc: str = ""

    @property
    def min_inputs(self) -> int:
        return sum(not i.endswith("?") for i in self.inputs)

    @property
    def variadic_outputs(self) -> bool:
        return self.outputs[-1].endswith("*")


PER_HEAD = ("HeadRMSNorm", "Rotary")  # ops between a q/k projection and the attention that act on each head alone

OPS: dict[str, OpSchema] = {
    "Embedding": OpSchema(("ids", "table"), ("x",), doc="x[b, s] = table[ids[b, s]] * scale (attr, default 1)"),
    "RMSNorm": OpSchema(("x", "weight"), ("y",), ("eps",), "x / rms(x) * weight"),
    "SkipRMSNorm": OpSchema(("x", "skip", "weight"), ("y", "sum"), ("eps",),
                            "sum = x + skip; y = RMSNorm(sum)"),
    "PositionEmbedding": OpSchema(("ids", "table"), ("x",), doc="x[b, s] = table[position of token (b, s)], "
                                  "positions from the runtime's seqlens_k / total_sequence_length (GPT-2)"),
    "LayerNorm": OpSchema(("x", "weight", "bias"), ("y",), ("eps",), "(x - mean) / std * weight + bias"),
    "SkipLayerNorm": OpSchema(("x", "skip", "weight", "bias"), ("y", "sum"), ("eps",),
                              "sum = x + skip; y = LayerNorm(sum)"),
    "HeadRMSNorm": OpSchema(("x", "weight"), ("y",), ("eps", "head_dim"),
                            "RMSNorm over each head of x [b, s, heads * head_dim], weight [head_dim] (Qwen3 q/k norm)"),
    "Linear": OpSchema(("x", "weight", "bias?"), ("y",), doc="x @ weight.T + bias, weight [out, in]"),
    "QuantLinear": OpSchema(("x", "q", "scales", "zero_points?", "bias?"), ("y",),
                            ("bits", "block_size", "K", "N", "accuracy_level"),
                            "Linear with a block-quantized weight in MatMulNBits layout: W = (q - zp) * scale "
                            "blockwise along K (builder/quant/schemes.py)"),
    "Rotary": OpSchema(("x",), ("y",), ("num_heads", "head_dim"),
                       "rotate each head of x by its position, rope tables in graph.meta.rope, or in "
                       "graph.meta.layer_ropes[table] with the optional attr table (a layer type)"),
    "Attention": OpSchema(("q", "k?", "v?", "sinks?", "k_scale?", "v_scale?"), ("y",),
                          ("layer", "num_heads", "kv_heads", "head_dim", "rotary", "packed_qkv"),
                          "causal attention over this layer's KV cache plus the new k, v; "
                          "packed_qkv: q holds [q | k | v]; rotary: q, k rotated inside; optional attrs: "
                          "window (keys at most window-1 positions back, None: all), softcap (tanh cap of the "
                          "scaled scores, 0: none), scale (default 1/sqrt(head_dim)), table (rotary: graph.meta.layer_ropes[table] "
                          "in place of graph.meta.rope); sinks [num_heads]: one more logit per head "
                          "in the softmax's denominator, attending to nothing (gpt-oss); k_scale, v_scale float32 [kv_heads, 1, "
                          "head_dim]: the cache holds int8 codes round(x / scale) of K (after rotary) and V"),
    "Split": OpSchema(("x",), ("parts*",), ("sizes",), "x [..., sum(sizes)] cut along its last axis into one part "
                      "per entry of sizes, in order (a fused q/k/v whose parts go on through their q/k norms, "
                      "builder/passes/fuse_qkv.py)"),
    "Activation": OpSchema(("x",), ("y",), ("fn",)),
    "GatedActivation": OpSchema(("x",), ("y",), ("fn",), "x = [gate | up]; y = fn(gate) * up"),
    "SoftCap": OpSchema(("x",), ("y",), ("cap",), "y = cap * tanh(x / cap) (Gemma-2 final logits)"),
    "Add": OpSchema(("a", "b"), ("y",)),
    "Mul": OpSchema(("a", "b"), ("y",)),
    "PermuteColumns": OpSchema(("x", "index"), ("y",), doc="y[..., j] = x[..., index[j]], index int64 [K] (the input "
                               "order of a GPTQ desc_act weight, builder/passes/permute_activations.py)"),
    "GatherTokens": OpSchema(("x", "index"), ("y",), doc="y[n] = x.reshape(-1, hidden)[index[n]]"),
    "BlockSum": OpSchema(("x",), ("y",), ("block",), "y[..., j] = sum of x[..., j*block:(j+1)*block] (the activation "
                         "term of a GGUF weight's block minimums, builder/passes/add_block_minimums.py)"),
    "LoRA": OpSchema(("x", "y", "a", "b", "ids"), ("z",), doc="z[t] = y[t] + (x[t] @ a[:, block]) @ b[block] per "
                     "token t, block the rank columns of slot ids[t] (none for slot 0): a [in, adapters * r], "
                     "b [adapters * r, out] float32 graph inputs, ids int64 [batch, seq] (builder/passes/add_lora.py)"),
    "AllReduce": OpSchema(("x",), ("y",), doc="y = sum of x over the tensor-parallel ranks (a segment cut)"),
    "QuantEmbedding": OpSchema(("ids", "q", "scales"), ("x",), ("bits", "block_size", "K"),
                               "Embedding over a symmetric block-quantized table in MatMulNBits layout "
                               "(shared with a tied QuantLinear lm_head): x[b, s] = dequant(q, scales)[ids[b, s]] (times the optional "
                               "attr scale, Gemma's sqrt(hidden))"),
    "MoE": OpSchema(("x", "router", "gate_up", "down", "router_bias?", "gate_up_bias?", "down_bias?"), ("y",),
                    ("top_k", "normalize", "activation"),
                    "mixture of experts over x [b, s, H]: logits = x @ router.T + router_bias [E]; softmax over "
                    "the E experts, the top_k largest, renormalised over them when normalize (softmax of the "
                    "top-k logits is the same); y = sum of weight * expert(x). gate_up [E, 2I, H] with rows "
                    "interleaved (2j: gate j, 2j+1: up j), down [E, H, I], biases [E, 2I] / [E, H]. activation "
                    "silu: silu(gate) * up; clamped_swiglu (attrs alpha, limit; gpt-oss): g = min(gate, limit), "
                    "u = clip(up, -limit, limit), g * sigmoid(alpha * g) * (u + 1)"),
    "QuantMoE": OpSchema(("x", "router", "gate_up_q", "gate_up_scales", "down_q", "down_scales", "router_bias?",
                          "gate_up_bias?", "down_bias?"), ("y",),
                         ("top_k", "normalize", "activation", "bits", "block_size", "accuracy_level"),
                         "MoE with symmetric quantized experts (router float): per expert the MatMulNBits bytes "
                         "q [E, N, K*bits/8] and scales [E, N, K/block_size], or [E, N] per output row when "
                         "block_size is 0; W = (q - 2^(bits-1)) * scale (builder/quant/experts.py)"),
    "ArgMax": OpSchema(("x",), ("y",), doc="y[n] = argmax(x[n, :]), int64 (the first of ties)"),
    "TopK": OpSchema(("x", "k"), ("values", "indices"), (),
                     "the k largest of x[n, :], sorted descending; indices int64; k an int64 [1] value"),
}
