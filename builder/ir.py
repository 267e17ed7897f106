"""A small typed dataflow IR: values with shape and dtype, nodes with an op and attributes, and
weights as lazy references to checkpoint tensors that are materialized only when an engine is written."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from builder.weights import Concat, WeightSource
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.types import CudaGraphs, Lora, QuantizationRecord, Rope, SamplingHead, to_json

Dim = int | str
DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "uint8")


@dataclass
class Value:
    """A typed edge of the graph: a graph input, a weight or a node output."""

    name: str
    shape: tuple[Dim, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"value {self.name!r}: dtype {self.dtype!r} is not one of {DTYPES}")
        self.shape = tuple(self.shape)

    def text(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


@dataclass
class Node:
    """One operation: `outputs = op(inputs, **attrs)`. An empty input name is an absent optional input."""

    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    @property
    def has_bias(self) -> bool:
        """A Linear's optional third input (its bias) is present."""
        return len(self.inputs) == 3 and bool(self.inputs[2])


@dataclass(frozen=True)
class Shard:
    """Which share of a tensor-parallel split a graph holds (ShardTensorParallel)."""

    size: int
    rank: int


@dataclass
class GraphMeta:
    """What the trace and the passes record about a graph: the manifest sections they fill, typed as the
    manifest types them (runtime/manifest/types.py), so the build writes them into manifest.json as they are.

    The trace sets `family`, `architecture`, `hyperparameters` (the traced HF config subset), `rope` (the
    table the runtime feeds) and `layer_ropes` (layer type -> its own table, computed in the graph: Gemma 3);
    PlanKVCache `kv_cache` and `max_seq_len_cap`; AppendSamplingHead `sampling_head`; PlanCudaGraphs
    `cuda_graphs`; SearchAWQScales `awq` and SolveGPTQ `gptq` (their records, which QuantizeWeights adds
    to its own); QuantizeWeights `quantization`; ShardTensorParallel `tensor_parallel`; AddLoRA `lora`. The trace sets
    `prequantized` (the source format) for a pre-quantized checkpoint (builder/quant/imported.py)."""

    family: str = ""
    architecture: str = ""
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    rope: Rope | None = None
    layer_ropes: dict[str, Rope] = field(default_factory=dict)
    kv_cache: KVCacheSpec | None = None
    max_seq_len_cap: int | None = None
    sampling_head: SamplingHead | None = None
    cuda_graphs: CudaGraphs = CudaGraphs()
    awq: dict[str, Any] | None = None
    gptq: dict[str, Any] | None = None
    prequantized: dict[str, Any] | None = None
    quantization: QuantizationRecord = QuantizationRecord()
    tensor_parallel: Shard | None = None
    lora: Lora | None = None

    def recorded(self) -> dict[str, Any]:
        """The fields set so far (those that differ from a fresh GraphMeta), in their JSON form."""
        fresh = GraphMeta()
        return {f.name: to_json(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(fresh, f.name)}


@dataclass
class Graph:
    """The model as a list of nodes in topological order, plus its weights and metadata.

    `meta` (GraphMeta) carries the typed facts the passes and the back end share: hyperparameters, rope
    tables, the KVCacheSpec once planned, the quantization record, ..."""

    name: str
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    values: dict[str, Value] = field(default_factory=dict)
    weights: dict[str, WeightSource] = field(default_factory=dict)
    meta: GraphMeta = field(default_factory=GraphMeta)
    _counter: int = 0

    # -- construction -------------------------------------------------------------------------
    def add_input(self, name: str, shape: tuple[Dim, ...], dtype: str) -> str:
        value = Value(name, shape, dtype)
        self.values[name] = value
        self.inputs.append(value)
        return name

    def add_output(self, name: str) -> None:
        self.outputs.append(self.values[name])

    def add_weight(self, name: str, source: WeightSource) -> str:
        if name in self.values:
            raise ValueError(f"weight {name!r} is already defined")
        self.values[name] = Value(name, source.shape, source.dtype)
        self.weights[name] = source
        return name

    def fresh(self, hint: str) -> str:
        self._counter += 1
        return f"{hint}.{self._counter}"

    def add_node(self, op: str, inputs: list[str], outputs: list[Value], name: str = "",
                 **attrs: Any) -> list[str]:
        """Append a node; its outputs are registered as values. Returns the output names."""
        for v in outputs:
            self.values[v.name] = v
        node = Node(op, list(inputs), [v.name for v in outputs], dict(attrs), name or self.fresh(op))
        self.nodes.append(node)
        return node.outputs

    def make(self, op: str, inputs: list[str], shape: tuple[Dim, ...], dtype: str, hint: str = "",
             *, out: str = "", **attrs: Any) -> str:
        """Append a single-output node and return its output name (`out`, or a fresh one)."""
        out = Value(out or self.fresh(hint or op.lower()), shape, dtype)
        return self.add_node(op, inputs, [out], **attrs)[0]

    # -- queries ------------------------------------------------------------------------------
    def producers(self) -> dict[str, Node]:
        return {out: n for n in self.nodes for out in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    users.setdefault(i, []).append(n)
        return users

    def uses(self) -> dict[str, list[Node | None]]:
        """Consumers of each value, with a graph output counted as one more use (None): what a fusion checks
        before it removes a node whose result it replaces."""
        users: dict[str, list[Node | None]] = dict(self.consumers())
        for out in self.outputs:
            users.setdefault(out.name, []).append(None)
        return users

    def drop_unused_weights(self, names: list[str]) -> None:
        """Forget those of `names` that no node or output reads any more (a fusion made them unused)."""
        used = {i for n in self.nodes for i in n.inputs} | {o.name for o in self.outputs}
        for name in set(names) - used:
            if name in self.weights:
                del self.weights[name], self.values[name]

    def nodes_of(self, op: str) -> Iterator[Node]:
        return (n for n in self.nodes if n.op == op)

    def replace_uses(self, old: str, new: str) -> None:
        """Make every consumer (and graph output) of `old` read `new` instead."""
        for n in self.nodes:
            n.inputs = [new if i == old else i for i in n.inputs]
        self.outputs = [self.values[new] if o.name == old else o for o in self.outputs]

    def copy(self) -> Graph:
        return dataclasses.replace(
            self, inputs=list(self.inputs), outputs=list(self.outputs),
            nodes=[dataclasses.replace(n, inputs=list(n.inputs), outputs=list(n.outputs),
                                       attrs=dict(n.attrs)) for n in self.nodes],
            values=dict(self.values), weights=dict(self.weights), meta=dataclasses.replace(self.meta))

    def num_parameters(self) -> int:
        return sum(int(np.prod(w.shape)) for w in self.weights.values())

    # -- rewrites -----------------------------------------------------------------------------
    def concat_linears(self, linears: list[Node], suffix: str) -> str:
        """Replace `linears` (see `concatenable`) by one Linear, at the first's place, whose weight (and bias)
        is the lazy row concatenation of theirs, named `<first weight's module>.<suffix>`; returns its output,
        theirs side by side. The fusions (fuse_qkv, fuse_gate_up) rewrite with it."""
        first = linears[0]
        prefix = first.inputs[1].rsplit(".", 1)[0]
        inputs = [first.inputs[0], self.add_weight(f"{prefix}.{suffix}", Concat([self.weights[p.inputs[1]]
                                                                                  for p in linears]))]
        if first.has_bias:
            inputs.append(self.add_weight(f"{prefix}.{suffix}_bias", Concat([self.weights[p.inputs[2]]
                                                                              for p in linears])))
        x = self.values[first.outputs[0]]
        width = sum(self.values[p.outputs[0]].shape[-1] for p in linears)
        out = Value(self.fresh(suffix), x.shape[:-1] + (width,), x.dtype)
        position = self.nodes.index(first)
        self.add_node("Linear", inputs, [out])
        self.nodes.insert(position, self.nodes.pop())
        self.nodes = [n for n in self.nodes if n not in linears]
        self.drop_unused_weights([w for p in linears for w in p.inputs[1:]])
        return out.name

    # -- text form ----------------------------------------------------------------------------
    def text(self) -> str:
        """A readable listing: inputs, weights with their lazy sources, nodes, outputs."""
        v = self.values
        lines = [f"graph {self.name}("
                 + ", ".join(f"%{i.name}: {i.text()}" for i in self.inputs) + ")"]
        for key, val in self.meta.recorded().items():
            lines.append(f"  meta {key} = {_short(val)}")
        for name, src in self.weights.items():
            lines.append(f"  weight %{name}: {v[name].text()} = {src}")
        for n in self.nodes:
            outs = ", ".join(f"%{o}: {v[o].text()}" for o in n.outputs)
            ins = ", ".join(f"%{i}" if i else "_" for i in n.inputs)
            attrs = "".join(f", {k}={_short(a)}" for k, a in n.attrs.items())
            lines.append(f"  {outs} = {n.op}({ins}{attrs})")
        lines.append("  return " + ", ".join(f"%{o.name}" for o in self.outputs))
        return "\n".join(lines) + "\n"


def concatenable(linears: list[Node | None], users: dict[str, list[Node | None]]) -> bool:
    """Whether `linears` can become one Linear (`Graph.concat_linears`): all Linears of the same input, all
    with a bias or none, each output read by one node only."""
    if any(p is None or p.op != "Linear" for p in linears):
        return False
    same_input = len({p.inputs[0] for p in linears}) == 1
    bias_all_or_none = len({p.has_bias for p in linears}) == 1
    return same_input and bias_all_or_none and all(len(users[p.outputs[0]]) == 1 for p in linears)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
