"""Back end: lower the IR to an ONNX graph for ONNX Runtime, with its fused contrib ops
(GroupQueryAttention with packed QKV, fused rotary and a shared past/present KV buffer,
SkipSimplifiedLayerNormalization, MatMulNBits for quantized linears: uint8 parts written as is, scales
in the target float dtype). Weights are streamed to one external-data file, one tensor at a time, and a
tensor written as stored in blocks of rows (WeightSource.row_blocks: a float embedding or lm_head is read,
converted and written BLOCK_BYTES at a time, never held whole)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper

from builder.ir import Graph, Node
from builder.lower_moe import MoELowering
from builder.lower_paged import PagedLowering
from builder.lower_rotary import LayerRopeLowering
from runtime.manifest.arith import ceil_div
from runtime.manifest.types import IO

OPSET = 21
IR_VERSION = 10  # what ONNX Runtime 1.2x and TensorRT 10 parsers read
MS = "com.microsoft"
ALIGN = 4096
BLOCK_BYTES = 64 << 20  # float32 bytes of one block of rows the writer converts at a time
ONNX_DTYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
              "int64": TensorProto.INT64, "int32": TensorProto.INT32, "uint8": TensorProto.UINT8,
              "int8": TensorProto.INT8}


class LoweringError(ValueError):
    """An IR op or attribute has no ONNX Runtime lowering."""


class WeightWriter:
    """Appends tensors to the external-data file and returns TensorProtos that point into it."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype = path, dtype
        self.file = path.open("wb")
        self.offset = 0

    def write(self, name: str, array: np.ndarray) -> TensorProto:
        return self.write_blocks(name, tuple(array.shape), iter([array]))

    def write_blocks(self, name: str, shape: tuple[int, ...], blocks: Iterator[np.ndarray]) -> TensorProto:
        """A tensor of `shape` given as consecutive blocks of rows, each cast and written as it comes."""
        pad = -self.offset % ALIGN
        self.file.write(b"\0" * pad)
        self.offset += pad
        start, data_type = self.offset, None
        for block in blocks:
            block = np.ascontiguousarray(_cast(block, self.dtype) if block.dtype.kind == "f" else block)
            data_type = data_type or _onnx_type(block)
            self.file.write(memoryview(block.reshape(-1).view(np.uint8)))  # the array's own bytes, no copy
            self.offset += block.nbytes
        tensor = TensorProto(name=name, dims=list(shape), data_type=data_type)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", start), ("length", self.offset - start)):
            tensor.external_data.add(key=key, value=str(value))
        return tensor

    def close(self) -> None:
        self.file.close()


def _cast(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return array.astype(ml_dtypes.bfloat16)
    return array.astype(dtype, copy=False)


def _onnx_type(array: np.ndarray) -> int:
    return TensorProto.BFLOAT16 if array.dtype.name == "bfloat16" else ONNX_DTYPE[array.dtype.name]


class Lowering(MoELowering, PagedLowering, LayerRopeLowering):
    """Translates one IR graph; `lower()` returns the ONNX model and its runtime interface."""

    def __init__(self, graph: Graph, data_path: Path, dtype: str = "float32",
                 progress: Callable[[str], None] | None = None):
        self.g, self.dtype = graph, dtype
        self.writer = WeightWriter(data_path, dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.progress = progress or (lambda name: None)
        self.kv = graph.meta.kv_cache
        self.io = IO(inputs={}, outputs={})  # the engine's interface, as the manifest records it
        self._inputs: list[onnx.ValueInfoProto] = []
        self._outputs: list[onnx.ValueInfoProto] = []
        self._emitted: set[str] = set()
        self.logits = graph.outputs[0].name if graph.outputs else ""  # cast to float32 at the end when the target dtype is not

    # -- interface ----------------------------------------------------------------------------
    def _input(self, name: str, dtype: str, shape: list) -> str:
        self._inputs.append(helper.make_tensor_value_info(name, ONNX_DTYPE[dtype], shape))
        self.io.inputs[name] = {"dtype": dtype, "shape": shape}
        return name

    def _output(self, name: str, dtype: str, shape: list) -> None:
        self._outputs.append(helper.make_tensor_value_info(name, ONNX_DTYPE[dtype], shape))
        self.io.outputs[name] = {"dtype": dtype, "shape": shape}

    def lower(self) -> tuple[onnx.ModelProto, IO]:
        try:
            self._declare_interface()
            for node in self.g.nodes:
                getattr(self, f"_lower_{node.op}", self._unsupported)(node)
        finally:
            self.writer.close()
        graph = helper.make_graph(self.nodes, self.g.name.replace(":", "_"), self._inputs, self._outputs,
                                  initializer=self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                        helper.make_opsetid(MS, 1)],
                                  producer_name="engine-build", ir_version=IR_VERSION)
        return model, self.io

    def _declare_interface(self) -> None:
        """The graph's inputs and outputs, the attention inputs (when the graph has attention) and each layer's
        KV buffer, past_ in and present_ out (the same buffer). A tensor-parallel segment (builder/segments.py)
        declares the same through `_kv_layers` and `_io_dtype`."""
        layers = self._kv_layers()
        for value in self.g.inputs:
            self._input(value.name, self._io_dtype(value.name), list(value.shape))
        if layers:
            self._declare_attention_inputs()
        kv_shape = ["batch", self.kv.kv_heads, "max_seq_len", self.kv.head_dim]
        if self.kv.block_size is not None:  # [num_blocks, block_size, kv_heads, head_dim]: the pool
            kv_shape = ["num_blocks", self.kv.block_size, self.kv.kv_heads, self.kv.head_dim]
        kv_dtype = self.kv.storage or self.dtype  # int8 codes, or the activations' dtype
        for layer in layers:
            for kind in ("key", "value"):
                self._input(f"past_{kind}_{layer}", kv_dtype, kv_shape)
        for value in self.g.outputs:
            self._output(value.name, self._io_dtype(value.name), list(value.shape))
        for layer in layers:
            for kind in ("key", "value"):
                self._output(f"present_{kind}_{layer}", kv_dtype, kv_shape)

    def _declare_attention_inputs(self) -> None:
        """What every attention layer reads besides its KV: the sequence lengths (or the paged block tables)
        and the rotary tables."""
        if self.kv.block_size is None:
            self._input("seqlens_k", "int32", ["batch"])
            self._input("total_sequence_length", "int32", [])
        else:
            self._declare_paged_inputs()
        half = len(self.g.meta.rope.inv_freq)  # head_dim / 2, less with partial rotary (Phi-3)
        self._input("cos_cache", self.dtype, ["rope_len", half])
        self._input("sin_cache", self.dtype, ["rope_len", half])

    def _kv_layers(self) -> list[int]:
        """The layers whose KV this graph reads and writes: every layer of the model."""
        return list(range(self.kv.num_layers))

    def _io_dtype(self, name: str) -> str:
        """The dtype an input or output crosses the interface in: the value's own."""
        return self.g.values[name].dtype

    # -- helpers ------------------------------------------------------------------------------
    def _emit(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> None:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{len(self.nodes)}",
                                           domain=domain, **attrs))

    def _weight(self, name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None,
                suffix: str = "") -> str:
        """Materialize weight `name` (once per transform) into the external-data file."""
        out = name + suffix
        if out not in self._emitted:
            self.progress(out)
            source = self.g.weights[name]
            if transform is None:
                tensor = self.writer.write_blocks(out, tuple(source.shape), source.row_blocks(BLOCK_BYTES))
            else:
                tensor = self.writer.write(out, transform(source.materialize()))
            self.initializers.append(tensor)
            self._emitted.add(out)
        return out

    def _const(self, name: str, array: np.ndarray) -> str:
        if name not in self._emitted:
            self.initializers.append(helper.make_tensor(name, _onnx_type(array), array.shape,
                                                        array.flatten().tolist()))
            self._emitted.add(name)
        return name

    def _value(self, name: str) -> str:
        return name + ".pre_cast" if name == self.logits and self.dtype != "float32" else name

    def _refuse(self, message: str) -> None:
        raise LoweringError(message)

    def _attention_options(self, n: Node) -> dict:
        return attention_options(n)

    def _unsupported(self, node: Node) -> None:
        raise LoweringError(f"{node.name}: op {node.op} has no ONNX Runtime lowering "
                            f"(is a required pass, e.g. fold_rotary, missing from the pipeline?)")

    # -- ops ----------------------------------------------------------------------------------
    def _lower_Embedding(self, n: Node) -> None:
        scale = float(n.attrs.get("scale", 1.0))
        y = n.outputs[0]
        self._emit("Gather", [self._weight(n.inputs[1]), n.inputs[0]], [y + ".rows" if scale != 1.0 else y], axis=0)
        if scale != 1.0:  # Gemma: embeddings times sqrt(hidden), a float32 constant as in HF
            factor = self._const(f"embedding_scale.{y}", _cast(np.array(scale, np.float32), self.dtype))
            self._emit("Mul", [y + ".rows", factor], [y])

    def _lower_RMSNorm(self, n: Node) -> None:
        self._emit("SimplifiedLayerNormalization", [n.inputs[0], self._weight(n.inputs[1])], n.outputs[:1],
                   axis=-1, epsilon=float(n.attrs["eps"]), stash_type=1)

    def _lower_PositionEmbedding(self, n: Node) -> None:
        """The table's rows at each token's position (LayerRopeLowering._token_positions)."""
        self._emit("Gather", [self._weight(n.inputs[1]), self._token_positions(n.inputs[0])], n.outputs, axis=0)

    def _lower_LayerNorm(self, n: Node) -> None:
        x, w, b = n.inputs
        self._emit("LayerNormalization", [x, self._weight(w), self._weight(b)], n.outputs, axis=-1,
                   epsilon=float(n.attrs["eps"]))

    def _lower_HeadRMSNorm(self, n: Node) -> None:
        """x [b, s, heads * dim] -> [b, s, heads, dim] -> RMSNorm over dim -> back (Qwen3 q/k norm)."""
        x, y = n.inputs[0], n.outputs[0]
        heads = self._const(f"shape.heads_{n.attrs['head_dim']}", np.array([0, 0, -1, n.attrs["head_dim"]], np.int64))
        self._emit("Reshape", [x, heads], [y + ".heads"])
        self._emit("SimplifiedLayerNormalization", [y + ".heads", self._weight(n.inputs[1])], [y + ".normed"],
                   axis=-1, epsilon=float(n.attrs["eps"]), stash_type=1)
        self._emit("Reshape", [y + ".normed", self._const("shape.merge_heads", np.array([0, 0, -1], np.int64))],
                   [y])

    def _lower_SkipRMSNorm(self, n: Node) -> None:
        x, skip, w = n.inputs
        self._emit("SkipSimplifiedLayerNormalization", [x, skip, self._weight(w)],
                   [n.outputs[0], "", "", n.outputs[1]], domain=MS, epsilon=float(n.attrs["eps"]))

    def _lower_SkipLayerNorm(self, n: Node) -> None:
        x, skip, w, b = n.inputs
        self._emit("SkipLayerNormalization", [x, skip, self._weight(w), self._weight(b)],
                   [n.outputs[0], "", "", n.outputs[1]], domain=MS, epsilon=float(n.attrs["eps"]))

    def _lower_Linear(self, n: Node) -> None:
        x, w = n.inputs[:2]
        y = self._value(n.outputs[0])
        if len(self.g.values[x].shape) == 2 and len(n.inputs) == 2:  # [tokens, in]: Gemm reads W as stored
            self._emit("Gemm", [x, self._weight(w)], [y], transB=1)
        else:
            product = y if len(n.inputs) == 2 else y + ".matmul"
            self._emit("MatMul", [x, self._weight(w, np.transpose, ".T")], [product])
            if len(n.inputs) == 3:
                self._emit("Add", [product, self._weight(n.inputs[2])], [y])
        if y != n.outputs[0]:
            self._emit("Cast", [y], [n.outputs[0]], to=TensorProto.FLOAT)

    def _lower_QuantLinear(self, n: Node) -> None:
        x, q, scales, zero_points, bias = (n.inputs + ["", ""])[:5]
        attrs = {key: int(n.attrs[key]) for key in ("K", "N", "bits", "block_size", "accuracy_level")}
        block = attrs["block_size"]
        layout = (attrs["N"], ceil_div(attrs["K"], block), block * attrs["bits"] // 8)  # a partial last block is padded
        if tuple(self.g.values[q].shape) != layout:
            raise LoweringError(f"{n.name}: MatMulNBits weight {q} has shape {tuple(self.g.values[q].shape)}, "
                                f"its attributes {attrs} need {layout}")
        y = self._value(n.outputs[0])
        product = y + ".matmul" if bias else y
        weights = [self._weight(q), self._weight(scales)] + ([self._weight(zero_points)] if zero_points else [])
        self._emit("MatMulNBits", [x] + weights, [product], domain=MS, **attrs)
        if bias:
            self._emit("Add", [product, self._weight(bias)], [y])
        if y != n.outputs[0]:
            self._emit("Cast", [y], [n.outputs[0]], to=TensorProto.FLOAT)

    def _lower_Attention(self, n: Node) -> None:
        if self.kv.block_size is not None:
            return self._paged_attention(n)
        rotary = self.g.meta.rope.type != "none"
        if rotary and not n.attrs["rotary"]:
            raise LoweringError(f"{n.name}: GroupQueryAttention needs the rotary folded in (fold_rotary)")
        if n.attrs["head_dim"] % 16:
            raise LoweringError(f"{n.name}: GroupQueryAttention needs head_dim a multiple of 16, "
                                f"the model has {n.attrs['head_dim']}")
        layer = n.attrs["layer"]
        q, k, v, sinks, k_scale, v_scale = (n.inputs + [""] * 5)[:6]
        if rotary and n.attrs.get("table") is not None:  # its own table: rotated before the kernel (lower_rotary.py)
            q, k = self._rotate_by_layer_table(n, q, k)
            rotary = False
        inputs = [q, k, v, f"past_key_{layer}", f"past_value_{layer}", "seqlens_k", "total_sequence_length"]
        inputs += ["cos_cache", "sin_cache"] if rotary else ["", ""]
        inputs += ["", "", self._weight(sinks) if sinks else ""]  # position_ids, attention_bias, head_sink
        inputs += [self._float32(k_scale), self._float32(v_scale)] if k_scale else []
        while not inputs[-1]:
            inputs.pop()
        self._emit("GroupQueryAttention", inputs,
                   [n.outputs[0], f"present_key_{layer}", f"present_value_{layer}"], domain=MS,
                   num_heads=n.attrs["num_heads"], kv_num_heads=n.attrs["kv_heads"], do_rotary=int(rotary),
                   rotary_interleaved=int(self.g.meta.rope.interleaved), **attention_options(n),
                   **(quantized_kv(self.kv.storage_dtype) if k_scale else {}))

    def _float32(self, name: str) -> str:
        """A small weight kept float32 whatever the target dtype (GroupQueryAttention's KV scales)."""
        return self._const(name, np.asarray(self.g.weights[name].materialize(), np.float32))

    def _lower_Activation(self, n: Node) -> None:
        self._activation(n.inputs[0], n.outputs[0], n.attrs["fn"], n.name)

    def _activation(self, x: str, y: str, fn: str, where: str) -> None:
        if fn == "silu":
            self._emit("Sigmoid", [x], [y + ".sigmoid"])
            self._emit("Mul", [x, y + ".sigmoid"], [y])
        elif fn == "sigmoid":  # Qwen2-MoE's shared-expert gate
            self._emit("Sigmoid", [x], [y])
        elif fn in GELU_APPROXIMATION:
            self._emit("Gelu", [x], [y], approximate=GELU_APPROXIMATION[fn])
        else:
            raise LoweringError(f"{where}: activation {fn!r} has no lowering; "
                                f"supported: {['silu', 'sigmoid'] + sorted(GELU_APPROXIMATION)}")

    def _lower_Split(self, n: Node) -> None:
        sizes = np.array(n.attrs["sizes"], np.int64)
        split = self._const(f"split.{'_'.join(str(s) for s in sizes)}", sizes)
        self._emit("Split", [n.inputs[0], split], n.outputs, axis=-1)

    def _lower_GatedActivation(self, n: Node) -> None:
        x, y = n.inputs[0], n.outputs[0]
        self._emit("Split", [x], [y + ".gate", y + ".up"], axis=-1, num_outputs=2)
        self._activation(y + ".gate", y + ".act", n.attrs["fn"], n.name)
        self._emit("Mul", [y + ".act", y + ".up"], [y])

    def _lower_SoftCap(self, n: Node) -> None:
        x, y, cap = n.inputs[0], n.outputs[0], np.array(n.attrs["cap"], np.float32)
        self._emit("Cast", [x], [y + ".f32"], to=TensorProto.FLOAT)  # capped in float32, as the output is
        self._emit("Div", [y + ".f32", self._const(f"softcap.{y}", cap)], [y + ".scaled"])
        self._emit("Tanh", [y + ".scaled"], [y + ".tanh"])
        self._emit("Mul", [y + ".tanh", f"softcap.{y}"], [y])

    def _lower_Add(self, n: Node) -> None:
        self._emit("Add", n.inputs, n.outputs)

    def _lower_Mul(self, n: Node) -> None:
        self._emit("Mul", n.inputs, n.outputs)

    def _lower_GatherTokens(self, n: Node) -> None:
        x, index = n.inputs
        hidden = self.g.values[x].shape[-1]
        flat = self._const(f"shape.tokens_{hidden}", np.array([-1, hidden], dtype=np.int64))
        self._emit("Reshape", [x, flat], [n.outputs[0] + ".flat"])
        self._emit("Gather", [n.outputs[0] + ".flat", index], n.outputs, axis=0)

    def _lower_LoRA(self, n: Node) -> None:
        """y + (x[t] @ A[:, slot t]) @ B[slot t] on the tokens t that run on an adapter only, written into y in
        place (ScatterND add): base tokens cost nothing but the empty calls. A is [in, max_adapters * r] and B
        [max_adapters * r, out] (each adapter's rank block side by side, laid out for the GEMM at load): one 2-D
        MatMul over every adapter's A, the other adapters' rank columns zeroed by the token's slot mask, one
        MatMul with B. Every adapter's A and B is read once per call, whatever the tokens' adapters."""
        x, y, a, b, ids = n.inputs
        if len(self.g.values[x].shape) != 3:
            self._refuse(f"LoRA {n.name}: input {x} is not [batch, seq, in]")
        width = self.g.values[a].shape[1]
        rows, mask = self._lora_rows(ids), self._lora_mask(ids, width // (self.g.meta.lora.max_adapters), width)
        out = n.outputs[0]
        self._emit("GatherND", [x, rows], [out + ".x"])
        self._emit("MatMul", [out + ".x", a], [out + ".h"])
        self._emit("Mul", [out + ".h", mask], [out + ".hm"])
        self._emit("MatMul", [out + ".hm", b], [out + ".delta"])
        self._emit("ScatterND", [y, rows, out + ".delta"], [out], reduction="add")

    def _lora_rows(self, ids: str) -> str:
        """int64 [k, 2]: the (batch, seq) index of each token on an adapter (slot > 0), once per graph."""
        rows = f"{ids}.rows"
        if rows not in self._emitted:
            self._emitted.add(rows)
            self._emit("Greater", [ids, self._const("lora.zero", np.array(0, np.int64))], [rows + ".on"])
            self._emit("NonZero", [rows + ".on"], [rows + ".t"])
            self._emit("Transpose", [rows + ".t"], [rows], perm=[1, 0])
        return rows

    def _lora_mask(self, ids: str, rank: int, width: int) -> str:
        """float32 [k, width]: 1 in the rank block of each adapter token's slot (row s of a constant [slots,
        width] with ones at columns (s-1)*rank .. s*rank), once per graph and width."""
        mask = f"{ids}.mask{width}"
        if mask not in self._emitted:
            self._emitted.add(mask)
            slots = width // rank + 1
            blocks = np.zeros((slots, width), np.float32)
            for s in range(1, slots):
                blocks[s, (s - 1) * rank:s * rank] = 1
            token_ids = f"{ids}.on_adapter"
            if token_ids not in self._emitted:
                self._emitted.add(token_ids)
                self._emit("GatherND", [ids, self._lora_rows(ids)], [token_ids])
            self._emit("Gather", [self._const(f"lora.blocks{width}", blocks), token_ids], [mask], axis=0)
        return mask

    def _lower_BlockSum(self, n: Node) -> None:
        x, block = n.inputs[0], int(n.attrs["block"])
        shape = self.g.values[x].shape
        split = [0] * (len(shape) - 1) + [-1, block]
        self._emit("Reshape", [x, self._const(f"shape.blocks_{len(shape)}_{block}", np.array(split, np.int64))],
                   [n.outputs[0] + ".blocks"])
        self._emit("ReduceSum", [n.outputs[0] + ".blocks", self._const("axes.last", np.array([-1], np.int64))],
                   n.outputs, keepdims=0)

    def _lower_PermuteColumns(self, n: Node) -> None:
        self._emit("Gather", [n.inputs[0], self._weight(n.inputs[1])], n.outputs, axis=-1)

    # -- quantized tied embedding (builder/passes/quantize_weights.py) --------------------------
    def _lower_QuantEmbedding(self, n: Node) -> None:
        """GatherBlockQuantized over the lm_head's MatMulNBits bytes q [N, blocks, block*bits/8], one
        block per (row, block) along axis 2, so q is read as stored; only the scales [N, blocks] are
        viewed as [N, blocks, 1] (a small copy after constant folding). Rows come out [.., blocks, block]."""
        ids, q, scales = n.inputs
        rows, blocks, _ = self.g.values[q].shape
        out = n.outputs[0]
        shape3 = self._const(f"shape.scales_{rows}_{blocks}_1", np.array([rows, blocks, 1], dtype=np.int64))
        self._emit("Reshape", [self._weight(scales), shape3], [out + ".scales"])
        self._emit("GatherBlockQuantized", [self._weight(q), ids, out + ".scales"], [out + ".blocks"], domain=MS,
                   bits=int(n.attrs["bits"]), block_size=int(n.attrs["block_size"]), gather_axis=0, quantize_axis=2)
        flat = self._const(f"shape.rows_{n.attrs['K']}", np.array([0, 0, n.attrs["K"]], dtype=np.int64))
        scale = float(n.attrs.get("scale", 1.0))
        self._emit("Reshape", [out + ".blocks", flat], [out + ".rows" if scale != 1.0 else out])
        if scale != 1.0:  # Gemma: embeddings times sqrt(hidden), as _lower_Embedding
            factor = self._const(f"embedding_scale.{out}", _cast(np.array(scale, np.float32), self.dtype))
            self._emit("Mul", [out + ".rows", factor], [out])

    # -- sampling head (builder/passes/append_sampling_head.py) --------------------------------
    def _lower_ArgMax(self, n: Node) -> None:
        self._emit("ArgMax", n.inputs, n.outputs, axis=-1, keepdims=0, select_last_index=0)

    def _lower_TopK(self, n: Node) -> None:
        self._emit("TopK", n.inputs, n.outputs, axis=-1, largest=1, sorted=1)


GELU_APPROXIMATION = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # ONNX Gelu-20


def attention_options(n: Node) -> dict:
    """GroupQueryAttention attributes for the optional Attention attrs. HF's window w lets a query see
    itself and w-1 earlier keys; ORT 1.32's CPU kernel reads local_window_size the same way (measured:
    w - 1 diverges from transformers at position w - 1, tests/builder/test_families.py)."""
    options = {}
    if n.attrs.get("window") is not None:
        options["local_window_size"] = int(n.attrs["window"])
    if n.attrs.get("softcap"):
        options["softcap"] = float(n.attrs["softcap"])
    if n.attrs.get("scale") is not None and not np.isclose(n.attrs["scale"], n.attrs["head_dim"] ** -0.5, rtol=1e-7):
        options["scale"] = float(n.attrs["scale"])
    return options


def quantized_kv(storage: str) -> dict:
    """GroupQueryAttention's attributes for a cache of int8 codes with per-channel scales [kv_heads, 1, head_dim]
    (ONNX Runtime 1.32's CPU kernel requires the same quant type for K and V)."""
    if storage != "int8":
        raise LoweringError(f"KV scales given but the KV plan stores {storage}; quantized KV storage: int8")
    return {"kv_cache_bit_width": 8, "k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL"}


def lower_to_onnx(graph: Graph, model_path: Path, dtype: str = "float32",
                  progress: Callable[[str], None] | None = None) -> IO:
    """Write `model_path` and its external data `<model_path>.data`; returns the runtime interface."""
    data_path = model_path.with_name(model_path.name + ".data")
    model, io = Lowering(graph, data_path, dtype, progress).lower()
    onnx.save_model(model, str(model_path))
    return io
