"""The IR's operator set: arity and required attributes of each op, checked by the verifier."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSchema:
    """`inputs` names the operands; a trailing `?` marks an optional one."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[str, ...] = ()
    doc: str = ""

    @property
    def min_inputs(self) -> int:
        return sum(not i.endswith("?") for i in self.inputs)


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
                       "rotate each head of x by its position, rope tables in graph.meta.rope"),
    "Attention": OpSchema(("q", "k?", "v?"), ("y",),
                          ("layer", "num_heads", "kv_heads", "head_dim", "rotary", "packed_qkv"),
                          "causal attention over this layer's KV cache plus the new k, v; "
                          "packed_qkv: q holds [q | k | v]; rotary: q, k rotated inside; optional attrs: "
                          "window (keys at most window-1 positions back, None: all), softcap (tanh cap of the "
                          "scaled scores, 0: none), scale (default 1/sqrt(head_dim))"),
    "Activation": OpSchema(("x",), ("y",), ("fn",)),
    "GatedActivation": OpSchema(("x",), ("y",), ("fn",), "x = [gate | up]; y = fn(gate) * up"),
    "SoftCap": OpSchema(("x",), ("y",), ("cap",), "y = cap * tanh(x / cap) (Gemma-2 final logits)"),
    "Add": OpSchema(("a", "b"), ("y",)),
    "Mul": OpSchema(("a", "b"), ("y",)),
    "GatherTokens": OpSchema(("x", "index"), ("y",), doc="y[n] = x.reshape(-1, hidden)[index[n]]"),
    "AllReduce": OpSchema(("x",), ("y",), doc="y = sum of x over the tensor-parallel ranks (a segment cut)"),
    "QuantEmbedding": OpSchema(("ids", "q", "scales"), ("x",), ("bits", "block_size", "K"),
                               "Embedding over a symmetric block-quantized table in MatMulNBits layout "
                               "(shared with a tied QuantLinear lm_head): x[b, s] = dequant(q, scales)[ids[b, s]]"),
    "ArgMax": OpSchema(("x",), ("y",), doc="y[n] = argmax(x[n, :]), int64 (the first of ties)"),
    "TopK": OpSchema(("x", "k"), ("values", "indices"), (),
                     "the k largest of x[n, :], sorted descending; indices int64; k an int64 [1] value"),
}
