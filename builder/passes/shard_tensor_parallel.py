"""ShardTensorParallel: keep one rank's share of a Megatron-style tensor-parallel split.

Runs after fusion and before quantization (so int8/int4 quantize each shard):
- attention is split by whole heads: rank r keeps query heads [r*H/tp, (r+1)*H/tp) and the KV heads those
  queries read. With kv_heads >= tp the KV heads are split too (kv_heads must divide by tp); with
  kv_heads < tp each KV head is replicated on tp/kv_heads ranks. A packed QKV Linear (fused by fuse_qkv or
  in the checkpoint) keeps those heads' output rows; separate q, k and v Linears keep theirs each, and the
  per-head ops between a projection and the attention (Qwen3's q/k HeadRMSNorm) narrow with it; a fused q/k/v
  Linear whose Split feeds those per-head ops (fuse_qkv) keeps the rows of all three parts, its Split narrowed;
- the MLP's first Linears are split by output rows, the same intermediate channels of each: a fused
  gate/up, separate gate and up, or the one up projection of a plain MLP (GPT-2);
- o_proj and down_proj are split by input columns; their partial sums are summed over the ranks by an
  `AllReduce` node that follows them (a bias of theirs is kept on rank 0 only, so it is added once);
- a mixture-of-experts layer's experts are split as its dense MLP would be (each expert keeps the rank's
  intermediate channels; the router stays whole) and its output all-reduced; pre-quantized experts are
  refused by name;
- the embedding and lm_head stay whole (replicated): the gather of an embedding row is cheap and the
  graph after the last all-reduce is the same on every rank, so only rank 0 runs it (builder.segments).
Weights become lazy `Slice`s: each rank reads only its share of each checkpoint tensor; a pre-quantized
one (GGUF blocks with their minimums, GPTQ / AWQ) keeps its own integers, split by rows or whole blocks
(builder/shard_weights.py `shard`; a split inside a block is refused). What cannot be split
(pre-quantized experts, a desc_act column permutation) is refused by name."""
from __future__ import annotations

from builder.ir import Graph, Node, Shard, Value
from builder.ops import PER_HEAD
from builder.pass_manager import Pass
from builder.shard_weights import shard


class ShardError(ValueError):
    """The model cannot be split over this many ranks."""


class ShardTensorParallel(Pass):
    """Rank `rank` of `tp`: the q/k/v (packed or not) and the MLP's first Linears split by output rows, o_proj
    and down_proj by input columns with an AllReduce after each; graph.meta records the rank."""

    name = "shard_tensor_parallel"

    def __init__(self, tp: int, rank: int):
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is outside 0..{tp - 1}")
        self.tp, self.rank = tp, rank

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        quantized = next((n for n in g.nodes if n.op == "QuantMoE" or n.op == "MoE" and _prequantized(g, n)), None)
        if quantized is not None:  # its blocks span the expert's rows and columns as stored
            raise ShardError(f"tensor_parallel > 1 does not split pre-quantized experts ({quantized.name} of the "
                             f"{g.meta.family or 'graph'} model): build from float experts or with "
                             f"parallel.tensor_parallel 1")
        permuted = next((n for n in g.nodes if n.op == "PermuteColumns"), None)
        if permuted is not None:  # its order spans the whole input, which row-parallel linears split
            raise ShardError(f"tensor_parallel > 1 is not supported for a GPTQ desc_act checkpoint whose g_idx "
                             f"permutes the input columns ({permuted.name}): build with parallel.tensor_parallel 1")
        producers, consumers = g.producers(), g.consumers()
        for attn in list(g.nodes_of("Attention")):
            self._shard_attention(g, attn, producers, consumers)
        for inner in [n for n in g.nodes if _mlp_inner(n, producers, consumers)]:
            self._shard_mlp(g, inner, producers, consumers)
        for moe in list(g.nodes_of("MoE")):
            self._shard_experts(g, moe)
        g.meta.tensor_parallel = Shard(self.tp, self.rank)
        return g

    # -- attention ----------------------------------------------------------------------------
    def _shard_attention(self, g: Graph, attn: Node, producers, consumers) -> None:
        heads, kv_heads, dim = attn.attrs["num_heads"], attn.attrs["kv_heads"], attn.attrs["head_dim"]
        if len(attn.inputs) > 3 and attn.inputs[3]:
            raise ShardError(f"{attn.name}: tensor_parallel > 1 does not split attention sinks yet; build with "
                             f"parallel.tensor_parallel 1")
        _divisible("num_heads", heads, self.tp)
        if kv_heads >= self.tp:
            _divisible("num_kv_heads", kv_heads, self.tp)
        elif self.tp % kv_heads:
            raise ShardError(f"num_kv_heads {kv_heads} is smaller than tensor_parallel {self.tp} and does not "
                             f"divide it; KV heads can be replicated only when tensor_parallel is a multiple of "
                             f"num_kv_heads")
        q0, nq = self.rank * heads // self.tp, heads // self.tp
        k0, nk = _kv_share(kv_heads, self.tp, self.rank)
        q_rows, kv_rows = (q0 * dim, (q0 + nq) * dim), (k0 * dim, (k0 + nk) * dim)
        if attn.attrs["packed_qkv"]:  # [q | k | v] rows of one Linear
            k_at, v_at = heads * dim, (heads + kv_heads) * dim
            _slice_outputs(g, producers[attn.inputs[0]], [q_rows, _shift(kv_rows, k_at), _shift(kv_rows, v_at)])
        else:
            ranges = (q_rows, kv_rows, kv_rows)
            ends = [self._narrow_per_head(g, value, rows, count, producers)
                    for value, rows, count in zip(attn.inputs[:3], ranges, (nq, nk, nk))]
            if ends[0].op == "Split":  # one fused Linear, [q | k | v] (fuse_qkv)
                _slice_split(g, ends, ranges, producers)
            else:
                for node, rows in zip(ends, ranges):
                    _slice_outputs(g, node, [rows])
        attn.attrs.update(num_heads=nq, kv_heads=nk)
        _narrow(g, attn.outputs[0], nq * dim)
        (o_proj,) = consumers[attn.outputs[0]]
        self._split_inputs(g, o_proj, [q_rows])

    def _narrow_per_head(self, g: Graph, value: str, rows: tuple[int, int], heads: int, producers) -> Node:
        """Narrow the per-head ops that make `value` to output channels `rows` (`heads` whole heads); returns the
        node before them, the projection (a Linear, or the Split of a fused one) to slice."""
        node = producers[value]
        while node.op in PER_HEAD:
            if "num_heads" in node.attrs:
                node.attrs["num_heads"] = heads
            _narrow(g, node.outputs[0], rows[1] - rows[0])
            node = producers[node.inputs[0]]
        return node

    # -- MLP ----------------------------------------------------------------------------------
    def _shard_mlp(self, g: Graph, inner: Node, producers, consumers) -> None:
        """`inner` makes the MLP's intermediate (builder/trace.py `_Block.mlp`): a GatedActivation over a fused
        gate/up, a Mul of act(gate) and up, or a plain MLP's Activation over up. Its Linears keep the rank's
        intermediate channels, and down_proj the same input columns."""
        inter = g.values[inner.outputs[0]].shape[-1]
        _divisible("intermediate_size", inter, self.tp)
        lo, hi = self.rank * inter // self.tp, (self.rank + 1) * inter // self.tp
        if inner.op == "GatedActivation":
            _slice_outputs(g, producers[inner.inputs[0]], [(lo, hi), (inter + lo, inter + hi)])
        elif inner.op == "Mul":
            gate = producers[inner.inputs[0]]
            _narrow(g, gate.outputs[0], hi - lo)
            _slice_outputs(g, producers[gate.inputs[0]], [(lo, hi)])
            _slice_outputs(g, producers[inner.inputs[1]], [(lo, hi)])
        else:
            _slice_outputs(g, producers[inner.inputs[0]], [(lo, hi)])
        _narrow(g, inner.outputs[0], hi - lo)
        (down,) = consumers[inner.outputs[0]]
        self._split_inputs(g, down, [(lo, hi)])

    # -- experts ------------------------------------------------------------------------------
    def _shard_experts(self, g: Graph, moe: Node) -> None:
        """Every expert keeps the rank's intermediate channels, as a dense MLP does (the router stays whole, so
        every rank routes each token to the same experts): gate_up [E, 2I, H], its gate and up rows interleaved,
        keeps rows [2 lo, 2 hi), down [E, H, I] columns [lo, hi); the experts' partial sums are all-reduced (a
        down bias added by rank 0 only)."""
        x, router, gate_up, down, *biases = moe.inputs + [""] * (7 - len(moe.inputs))
        inter = g.weights[gate_up].shape[1] // 2
        _divisible("moe_intermediate_size", inter, self.tp)
        lo, hi = self.rank * inter // self.tp, (self.rank + 1) * inter // self.tp
        sliced = {gate_up: (1, 2 * lo, 2 * hi), down: (2, lo, hi), biases[1]: (1, 2 * lo, 2 * hi)}
        for name, (axis, a, b) in sliced.items():
            if name:
                g.weights[name] = _shard(g.weights[name], axis, [(a, b)])
                g.values[name] = Value(name, g.weights[name].shape, g.weights[name].dtype)
        if biases[2] and self.rank != 0:
            moe.inputs[6] = ""  # the down bias is added once, by rank 0, before the sum
        while not moe.inputs[-1]:
            moe.inputs.pop()
        self._all_reduce_after(g, moe)

    # -- row-parallel Linear + all-reduce ------------------------------------------------------
    def _split_inputs(self, g: Graph, linear: Node, cols: list[tuple[int, int]]) -> None:
        if linear.op != "Linear":
            raise ShardError(f"{linear.name}: expected the row-parallel Linear after a split, found {linear.op}")
        linear.inputs[1] = _replace_weight(g, linear.inputs[1], _shard(g.weights[linear.inputs[1]], 1, cols))
        if len(linear.inputs) == 3 and self.rank != 0:
            linear.inputs.pop()  # the bias is added once, by rank 0, before the sum
        self._all_reduce_after(g, linear)

    def _all_reduce_after(self, g: Graph, linear: Node) -> None:
        """`linear` writes a partial sum; an AllReduce after it makes its output, summed over the ranks."""
        total = linear.outputs[0]
        partial = Value(f"{total}.partial", g.values[total].shape, g.values[total].dtype)
        g.values[partial.name] = partial
        linear.outputs[0] = partial.name
        reduce = Node("AllReduce", [partial.name], [total], {}, g.fresh("AllReduce"))
        g.nodes.insert(g.nodes.index(linear) + 1, reduce)


def _divisible(dimension: str, size: int, tp: int) -> None:
    if size % tp:
        raise ShardError(f"{dimension} {size} is not divisible by tensor_parallel {tp}; use a tensor_parallel "
                         f"that divides {size}")


def _mlp_inner(n: Node, producers, consumers) -> bool:
    """Whether `n` makes a dense MLP's intermediate, the input of down_proj."""
    if n.op == "GatedActivation":
        return True
    if n.op == "Mul":  # act(gate) * up
        gate = producers.get(n.inputs[0])
        return gate is not None and gate.op == "Activation"
    return n.op == "Activation" and [c.op for c in consumers.get(n.outputs[0], [])] == ["Linear"]  # act(up)


def _prequantized(g: Graph, moe: Node) -> bool:
    return any(isinstance(getattr(g.weights.get(i), "bits", None), int) for i in moe.inputs[2:4])


def _shift(rows: tuple[int, int], by: int) -> tuple[int, int]:
    return rows[0] + by, rows[1] + by


def _kv_share(kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) rank `rank` keeps; with fewer KV heads than ranks, one replicated head."""
    if kv_heads >= tp:
        return rank * kv_heads // tp, kv_heads // tp
    return rank // (tp // kv_heads), 1


def _slice_split(g: Graph, ends: list[Node], ranges: tuple, producers) -> None:
    """The fused q/k/v Linear before a Split keeps `ranges` of each part (q, k, v in order); the Split and its
    parts narrow to them."""
    split = ends[0]
    parts = [g.values[o].shape[-1] for o in split.outputs]
    if any(e is not split for e in ends) or len(parts) != 3:
        raise ShardError(f"{split.name}: expected one Split into q, k and v before the attention, found "
                         f"{[e.name for e in ends]}")
    starts = [0, parts[0], parts[0] + parts[1]]
    _slice_outputs(g, producers[split.inputs[0]], [_shift(rows, at) for rows, at in zip(ranges, starts)])
    split.attrs["sizes"] = [hi - lo for lo, hi in ranges]
    for out, width in zip(split.outputs, split.attrs["sizes"]):
        _narrow(g, out, width)


def _slice_outputs(g: Graph, linear: Node, rows: list[tuple[int, int]]) -> None:
    """Keep output channels `rows` of a column-parallel Linear (weight rows and bias entries)."""
    if linear.op != "Linear":
        raise ShardError(f"{linear.name}: expected a Linear to split by columns, found {linear.op}")
    for i in range(1, len(linear.inputs)):
        linear.inputs[i] = _replace_weight(g, linear.inputs[i], _shard(g.weights[linear.inputs[i]], 0, rows))
    _narrow(g, linear.outputs[0], sum(hi - lo for lo, hi in rows))


def _shard(source, axis: int, ranges: list[tuple[int, int]]):
    try:
        return shard(source, axis, ranges)
    except ValueError as error:  # a pre-quantized block the split would cut
        raise ShardError(str(error)) from error


def _replace_weight(g: Graph, name: str, source) -> str:
    """Swap weight `name` for its shard (same name: the engine's weights keep the checkpoint's names)."""
    if any(name in n.inputs for n in g.nodes if n.op not in ("Linear",)):
        raise ShardError(f"weight {name!r} is shared with a non-Linear node and cannot be split")
    g.weights[name] = source
    g.values[name] = Value(name, source.shape, source.dtype)
    return name


def _narrow(g: Graph, name: str, width: int) -> None:
    value = g.values[name]
    g.values[name] = Value(name, value.shape[:-1] + (width,), value.dtype)
