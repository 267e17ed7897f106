"""Lowering of Attention to ONNX Runtime's com.microsoft PagedAttention (recipe `target.attention: paged`;
CUDA only, float16/bfloat16: ONNX Runtime has no CPU kernel for it).

A paged engine runs one packed call per step: input_ids [1, tokens] holds every sequence's new tokens
back to back, no padding; the step's layout comes in as PagedAttention's own inputs
(runtime/model/paged_inputs.py builds them from the block manager's block ids):

    cumulative_sequence_length int32 [sequences + 1]   new-token offsets of each sequence in the packed rows
    past_seqlens               int32 [sequences]       tokens already cached (also the rotary position start)
    block_table                int32 [sequences, max_blocks]
    slot_mapping               int32 [tokens]          flat cache slot of each new token's K/V, -1: not written
    attention_metadata         int32 [2] (host)        bounds (longest query run, longest past + new) for the
                                                       kernel's launch sizes, so decode stays CUDA-graph capturable

and each layer's past_key_i / past_value_i is the block pool [num_blocks, block_size, kv_heads, head_dim],
updated in place (bound as present_key_i / present_value_i too, as the GQA engines' rows are)."""
from __future__ import annotations

import numpy as np

from builder.ir import Node

MS = "com.microsoft"
PAGED_INPUTS = {"cumulative_sequence_length": ["sequences_plus_1"], "past_seqlens": ["sequences"],
                "block_table": ["sequences", "max_blocks"], "slot_mapping": ["tokens"], "attention_metadata": [2]}


class PagedLowering:
    """Mixed into builder.lower_onnx.Lowering (uses its _input, _emit, _weight, _const, _float32, _refuse
    and _attention_options)."""

    def _declare_paged_inputs(self) -> None:
        if self.g.meta.rope.type == "none" or any(n.op == "PositionEmbedding" for n in self.g.nodes):
            self._refuse("target.attention paged needs a rotary model (PagedAttention derives positions from "
                                "past_seqlens); this model has learned positions: use attention gqa")
        for name, shape in PAGED_INPUTS.items():
            self._input(name, "int32", shape)

    def _paged_attention(self, n: Node) -> None:
        if n.attrs.get("window") is not None and n.attrs["window"] < self.kv.max_seq_len:
            self._refuse(f"{n.name}: paged attention with a sliding window is not lowered yet; use attention gqa")
        if n.attrs.get("table") is not None:
            self._refuse(f"{n.name}: paged attention with a layer's own rotary table (table={n.attrs['table']!r}, "
                         f"graph.meta.layer_ropes: Gemma 3's local layers) is not lowered yet; use attention gqa")
        layer, y = n.attrs["layer"], n.outputs[0]
        q, k, v, sinks, k_scale, v_scale = (n.inputs + [""] * 5)[:6]
        packed = [self._tokens(x) if x else "" for x in (q, k, v)]  # [tokens, width]
        inputs = packed + [f"past_key_{layer}", f"past_value_{layer}", "cumulative_sequence_length",
                           "past_seqlens", "block_table", "cos_cache", "sin_cache", "slot_mapping",
                           self._weight(sinks) if sinks else "", "", "",
                           self._float32(k_scale) if k_scale else "", self._float32(v_scale) if v_scale else "",
                           "attention_metadata"]
        quant = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL"} if k_scale else {}
        self._emit("PagedAttention", inputs, [y + ".tokens", f"present_key_{layer}", f"present_value_{layer}"],
                   domain=MS, num_heads=n.attrs["num_heads"], kv_num_heads=n.attrs["kv_heads"], do_rotary=1,
                   rotary_interleaved=int(self.g.meta.rope.interleaved), **self._attention_options(n), **quant)
        self._emit("Unsqueeze", [y + ".tokens", self._const("axes.first", np.array([0], np.int64))], [y])  # [1, tokens, h]

    def _tokens(self, x: str) -> str:
        """x [1, tokens, width] as [tokens, width] (the packed batch is one row)."""
        width = self.g.values[x].shape[-1]
        self._emit("Reshape", [x, self._const(f"shape.tokens_{width}", np.array([-1, width], np.int64))],
                   [x + ".packed"])
        return x + ".packed"
