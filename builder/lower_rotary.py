"""Lowering of a layer's own rotary table (an Attention with attr `table`: graph.meta.layer_ropes[table], e.g.
Gemma 3's sliding layers with their local rope base), for GroupQueryAttention engines.

The runtime feeds one table (cos_cache / sin_cache, from graph.meta.rope), which GroupQueryAttention applies
inside. A layer with another table rotates q and k itself before the kernel (com.microsoft RotaryEmbedding,
do_rotary 0 on its GroupQueryAttention), by cos/sin rows computed in the graph for this call's tokens only:
positions [b, s] as GroupQueryAttention derives them, freqs = position * inv_freq in float32 (as transformers
computes them), one row per token, and RotaryEmbedding's position_ids numbering those rows. The cost is
b * s * head_dim / 2 cosines and sines per call, shared by every layer of that table; nothing grows with the
sequence length (a baked [max_seq_len, head_dim / 2] table would, and once per tensor-parallel segment)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from builder.ir import Node

MS = "com.microsoft"


class LayerRopeLowering:
    """Mixed into builder.lower_onnx.Lowering (uses its _emit, _const, _refuse, g, dtype and _emitted)."""

    def _rotate_by_layer_table(self, n: Node, q: str, k: str) -> tuple[str, str]:
        """q and k of attention node `n` rotated by its own table; returns the rotated names."""
        if n.attrs["packed_qkv"]:
            self._refuse(f"{n.name}: a layer rotary table (attr table={n.attrs['table']!r}) needs unpacked q, k, v")
        ids, cos, sin = self._layer_rope_rows(n.attrs["table"], q)
        rope = self.g.meta.layer_ropes[n.attrs["table"]]
        partial = {"rotary_embedding_dim": 2 * len(rope.inv_freq)} \
            if 2 * len(rope.inv_freq) != n.attrs["head_dim"] else {}
        rotated = []
        for x, heads in ((q, n.attrs["num_heads"]), (k, n.attrs["kv_heads"])):
            self._emit("RotaryEmbedding", [x, ids, cos, sin], [x + ".rotated"], domain=MS, num_heads=heads,
                       interleaved=int(rope.interleaved), **partial)
            rotated.append(x + ".rotated")
        return rotated[0], rotated[1]

    def _layer_rope_rows(self, table: str, q: str) -> tuple[str, str, str]:
        """(row ids [b, s], cos [b * s, half], sin [b * s, half]) of `table` for this call's tokens (q: a
        [b, s, ..] value of this call), emitted once."""
        prefix = f"rope.{table}"
        names = (prefix + ".ids", prefix + ".cos", prefix + ".sin")
        if names[0] in self._emitted:
            return names
        rope = self.g.meta.layer_ropes[table]
        positions = self._token_positions(q)
        self._emit("Cast", [positions], [prefix + ".positions"], to=TensorProto.FLOAT)
        column = self._const("shape.column", np.array([-1, 1], np.int64))
        self._emit("Reshape", [prefix + ".positions", column], [prefix + ".column"])     # [b * s, 1]
        inv_freq = self._const(prefix + ".inv_freq", np.asarray(rope.inv_freq, np.float32))
        self._emit("Mul", [prefix + ".column", inv_freq], [prefix + ".freqs"])         # [b * s, half]
        scale = self._const(prefix + ".scaling", np.array(rope.attention_scaling, np.float32))
        for fn, name in (("Cos", names[1]), ("Sin", names[2])):
            self._emit(fn, [prefix + ".freqs"], [name + ".unscaled"])
            self._emit("Mul", [name + ".unscaled", scale], [name + ".f32"])
            self._emit("Cast", [name + ".f32"], [name], to=_FLOAT[self.dtype])
        one = self._const("int64.one", np.array(1, np.int64))
        zero = self._const("int64.zero", np.array(0, np.int64))
        self._emit("Size", [positions], [prefix + ".count"])
        self._emit("Range", [zero, prefix + ".count", one], [prefix + ".range"])
        self._emit("Shape", [positions], [prefix + ".shape"])
        self._emit("Reshape", [prefix + ".range", prefix + ".shape"], [names[0]])
        self._emitted.add(names[0])
        return names

    def _token_positions(self, like: str) -> str:
        """Each new token's position [b, s] int64 (`like`: any [b, s, ..] value of this call), the way
        GroupQueryAttention derives them: a first prompt (total_sequence_length == S) starts every row at
        0; otherwise row b's S new tokens end at seqlens_k[b]. Emitted once."""
        y = "token_positions"
        if y in self._emitted:
            return y
        one = self._const("int64.one", np.array(1, np.int64))
        zero = self._const("int64.zero", np.array(0, np.int64))
        self._emit("Shape", [like], [y + ".seq"], start=1, end=2)                      # [1] = S
        self._emit("Squeeze", [y + ".seq"], [y + ".s"])
        self._emit("Range", [zero, y + ".s", one], [y + ".arange"])                    # [S]
        self._emit("Cast", ["seqlens_k"], [y + ".past"], to=TensorProto.INT64)         # [b]
        self._emit("Sub", [y + ".past", y + ".s"], [y + ".start0"])
        self._emit("Add", [y + ".start0", one], [y + ".start"])                       # seqlens_k + 1 - S
        self._emit("Cast", ["total_sequence_length"], [y + ".total"], to=TensorProto.INT64)
        self._emit("Equal", [y + ".total", y + ".s"], [y + ".first"])
        self._emit("Where", [y + ".first", zero, y + ".start"], [y + ".offset"])     # [b]
        self._emit("Unsqueeze", [y + ".offset", self._const("axes.last", np.array([-1], np.int64))],
                   [y + ".column"])                                                 # [b, 1]
        self._emit("Add", [y + ".column", y + ".arange"], [y])                       # [b, S]
        self._emitted.add(y)
        return y


_FLOAT = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
