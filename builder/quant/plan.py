"""QuantizeMapping: which Linear weights a recipe quantizes, with which MatMulNBits layout, and why
the others stay float (only a weight that something other than a Linear also reads, except a tied
embedding QuantizeWeights can share, one an `exclude` pattern names, the lm_head under
`quantization.lm_head: none`, or one that is not 2-D: any K works, since a partial last
block is zero-padded). The QuantizeWeights pass rewrites the graph and creates the lazy quantized
weights from the same `QuantTarget`s, so the node attributes and the weight bytes cannot drift;
SearchAWQScales asks the same mapping which weights it may tune."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from builder.ir import Graph, Node
from builder.quant.schemes import SCHEMES, QuantOptions, QuantScheme, scheme_for
from builder.quant.weights import prequantized_layout, quantized_parts
from builder.weights import WeightSource


@dataclass(frozen=True)
class QuantTarget:
    """One weight W [N, K] to quantize with `scheme` in blocks of `block` along K (the last one
    zero-padded when `block` does not divide K). `run_block`: the block MatMulNBits runs it at, a divisor of
    `block` (None: `block`): the same values re-blocked exactly (builder/quant/weights.py `reblock`), so int8
    activations round per `run_block` values (`quantization.activation_block`)."""

    weight: str
    n: int
    k: int
    block: int
    scheme: QuantScheme
    run_block: int | None = None

    @property
    def kernel_block(self) -> int:
        return self.run_block or self.block

    def attrs(self, accuracy_level: int) -> dict:
        """The QuantLinear (and MatMulNBits) attributes."""
        return {"bits": self.scheme.bits, "block_size": self.kernel_block, "K": self.k, "N": self.n,
                "accuracy_level": accuracy_level}

    def layout(self) -> dict:
        """For the manifest; `last_block_padding`: zero values padding K to a multiple of the block;
        `stored_block`: the quantization's block where the kernel runs a smaller one."""
        padding = -self.k % self.kernel_block
        layout = {"N": self.n, "K": self.k, "block_size": self.kernel_block}
        layout = dict(layout, stored_block=self.block) if self.kernel_block != self.block else layout
        return dict(layout, last_block_padding=padding) if padding else layout

    def sources(self, source: WeightSource) -> dict[str, WeightSource]:
        """The lazy parts {"q", "scales"[, "zero_points"]} of `source` in this layout."""
        return quantized_parts(source, self.scheme.bits, self.block, self.scheme.symmetric, self.run_block)


@dataclass
class QuantizeMapping:
    """Weight name -> QuantTarget for the weights to quantize; weight name -> reason for the rest."""

    scheme: QuantScheme | None  # None: mode none (only a pre-quantized checkpoint's weights are targets)
    targets: dict[str, QuantTarget] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    source: dict | None = None  # a pre-quantized checkpoint's format (builder/quant/imported.py)

    def record(self, levels: dict) -> dict:
        """The JSON record kept in graph.meta.quantization and manifest.json; `levels`: the accuracy levels'
        record (builder/quant/levels.py)."""
        scheme = self.scheme or next((t.scheme for t in self.targets.values()), None)
        source = {"source": self.source} if self.source else {}
        # no scheme: a pre-quantized checkpoint whose linears are all float (a GGUF file's quantized experts only)
        return {"mode": scheme.name if scheme else self.source["format"], "scheme": scheme.to_dict() if scheme else {},
                **source, **levels,
                "quantized": {name: t.layout() for name, t in self.targets.items()},
                "skipped": dict(self.skipped)}


def plan_quantization(graph: Graph, options: QuantOptions) -> QuantizeMapping:
    """Decide, for every weight read by a Linear, whether and how `options` quantizes it. The
    lm_head (the Linear producing `logits`) follows `options.lm_head`. A pre-quantized checkpoint's
    weights are targets in their own layout, under mode none only; its float linears stay float."""
    source = graph.meta.prequantized
    if source and options.mode != "none":
        raise ValueError(f"the checkpoint is already quantized ({source['format']}, {source['bits']} bits): its "
                         f"integers are imported as they are; build it with quantization.mode none, not {options.mode}")
    mapping = QuantizeMapping(scheme_for(options) if options.mode != "none" else None, source=source)
    users = graph.consumers()
    head = lm_head_weight(graph)
    for node in graph.nodes_of("Linear"):
        name = node.inputs[1]
        if name in mapping.targets or name in mapping.skipped:
            continue
        if source:
            _plan_imported(graph, name, users.get(name, []), mapping)
            continue
        scheme = _lm_head_scheme(mapping.scheme, options) if name == head else mapping.scheme
        reason = _skip_reason(graph, name, users.get(name, []), options.exclude, scheme, name == head)
        if reason:
            mapping.skipped[name] = reason
        else:
            n, k = graph.weights[name].shape
            mapping.targets[name] = QuantTarget(name, n, k, scheme.group_size, scheme)
    return mapping


def _plan_imported(graph: Graph, name: str, users: list[Node], mapping: QuantizeMapping) -> None:
    """A weight of a pre-quantized checkpoint: a target in its stored layout, or float if stored float."""
    layout = prequantized_layout(graph.weights[name])
    if layout is None:
        mapping.skipped[name] = f"stored float in the {mapping.source['format']} checkpoint"
        return
    bits, block, symmetric = layout
    n, k = graph.weights[name].shape
    other = next((n for n in users if n.op != "Linear" or n.inputs[1] != name), None)
    if other is not None and other.op == "Embedding" and not _shares_rows(graph.weights[name], symmetric, k, block):
        mapping.skipped[name] = ("a tied embedding stored in a layout GatherBlockQuantized cannot read; kept float "
                                 "(its exact dequantized value)")
        return
    if other is not None and other.op != "Embedding":
        raise ValueError(f"pre-quantized weight {name} is also read by {other.op} {other.name}; only Linear "
                         f"weights can be imported quantized")
    scheme = QuantScheme(f"{mapping.source['format']}_int{bits}", bits, block, symmetric, group_from_recipe=False,
                         doc="imported from a pre-quantized checkpoint, repacked bit-exactly")
    mapping.targets[name] = QuantTarget(name, n, k, block, scheme)


def _shares_rows(source, symmetric: bool, k: int, block: int) -> bool:
    """An imported tied embedding read by row from the lm_head's bytes: symmetric blocks dividing K, and no
    GGUF block minimums (GatherBlockQuantized has no term for them)."""
    from builder.quant.weights import has_minimums

    return symmetric and k % block == 0 and not has_minimums(source)


def lm_head_weight(graph: Graph) -> str | None:
    """The weight of the Linear that computes the `logits` output (a tied embedding's name), if any."""
    return next((n.inputs[1] for n in graph.nodes_of("Linear") if n.outputs[0] == "logits"), None)


def _lm_head_scheme(scheme: QuantScheme, options: QuantOptions) -> QuantScheme | None:
    """The lm_head's scheme under quantization.lm_head; None: keep it float (`none`)."""
    if options.lm_head == "none":
        return None
    if options.lm_head in ("int8", "auto") and scheme.bits < 8:  # auto: 8 bits under a 4-bit scheme
        return dataclasses.replace(SCHEMES["int8"], symmetric=options.symmetric)
    return scheme


def _skip_reason(graph: Graph, name: str, users: list[Node], exclude: list[str],
                 scheme: QuantScheme | None, head: bool) -> str:
    if scheme is None:
        return "kept float by quantization.lm_head none"
    other = next((n for n in users if n.op != "Linear" or n.inputs[1] != name), None)
    if other is not None and not (other.op == "Embedding" and _shareable(graph, name, scheme)):
        tied = (" (a tied embedding is shared quantized only with symmetric blocks that divide K)"
                if other.op == "Embedding" else "")
        return f"also read by {other.op} {other.name}{tied}"
    names = (name, "lm_head") if head else (name,)  # a tied lm_head's weight is named for the embedding
    pattern = next((p for p in exclude if any(fnmatchcase(n, p) for n in names)), None)
    if pattern is not None:
        return f"excluded by pattern {pattern!r}"
    shape = graph.weights[name].shape
    if len(shape) != 2:
        return f"not a 2-D weight: shape {shape}"
    return ""


def _shareable(graph: Graph, name: str, scheme: QuantScheme) -> bool:
    """A tied embedding can read the lm_head's MatMulNBits bytes by row (GatherBlockQuantized) when
    the blocks are symmetric (default zero point) and divide K (no padded last block)."""
    shape = graph.weights[name].shape
    return len(shape) == 2 and scheme.symmetric and shape[1] % scheme.group_size == 0
