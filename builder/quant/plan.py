"""QuantizeMapping: which Linear weights a recipe quantizes, with which MatMulNBits layout, and why
the others stay float (only a weight that something other than a Linear also reads, such as a tied
embedding, one an `exclude` pattern names, or one that is not 2-D: any K works, since a partial last
block is zero-padded). The QuantizeWeights pass rewrites the graph and creates the lazy quantized
weights from the same `QuantTarget`s, so the node attributes and the weight bytes cannot drift;
SearchAWQScales asks the same mapping which weights it may tune."""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from builder.ir import Graph, Node
from builder.quant.schemes import QuantOptions, QuantScheme, scheme_for
from builder.quant.weights import quantized_parts
from builder.weights import WeightSource


@dataclass(frozen=True)
class QuantTarget:
    """One weight W [N, K] to quantize with `scheme` in blocks of `block` along K (the last one
    zero-padded when `block` does not divide K)."""

    weight: str
    n: int
    k: int
    block: int
    scheme: QuantScheme

    def attrs(self, accuracy_level: int) -> dict:
        """The QuantLinear (and MatMulNBits) attributes."""
        return {"bits": self.scheme.bits, "block_size": self.block, "K": self.k, "N": self.n,
                "accuracy_level": accuracy_level}

    def layout(self) -> dict:
        """For the manifest; `last_block_padding`: zero values padding K to a multiple of the block."""
        padding = -self.k % self.block
        layout = {"N": self.n, "K": self.k, "block_size": self.block}
        return dict(layout, last_block_padding=padding) if padding else layout

    def sources(self, source: WeightSource) -> dict[str, WeightSource]:
        """The lazy parts {"q", "scales"[, "zero_points"]} of `source` in this layout."""
        return quantized_parts(source, self.scheme.bits, self.block, self.scheme.symmetric)


@dataclass
class QuantizeMapping:
    """Weight name -> QuantTarget for the weights to quantize; weight name -> reason for the rest."""

    scheme: QuantScheme
    targets: dict[str, QuantTarget] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def record(self, accuracy_level: int) -> dict:
        """The JSON record kept in graph.meta["quantization"] and manifest.json."""
        return {"mode": self.scheme.name, "scheme": self.scheme.to_dict(), "accuracy_level": accuracy_level,
                "quantized": {name: t.layout() for name, t in self.targets.items()},
                "skipped": dict(self.skipped)}


def plan_quantization(graph: Graph, options: QuantOptions) -> QuantizeMapping:
    """Decide, for every weight read by a Linear, whether and how `options` quantizes it."""
    mapping = QuantizeMapping(scheme_for(options))
    users = graph.consumers()
    for node in graph.nodes_of("Linear"):
        name = node.inputs[1]
        if name in mapping.targets or name in mapping.skipped:
            continue
        reason = _skip_reason(graph, name, users.get(name, []), options.exclude)
        if reason:
            mapping.skipped[name] = reason
        else:
            n, k = graph.weights[name].shape
            mapping.targets[name] = QuantTarget(name, n, k, mapping.scheme.group_size, mapping.scheme)
    return mapping


def _skip_reason(graph: Graph, name: str, users: list[Node], exclude: list[str]) -> str:
    other = next((n for n in users if n.op != "Linear" or n.inputs[1] != name), None)
    if other is not None:
        tied = " (tied embeddings stay full precision)" if other.op == "Embedding" else ""
        return f"also read by {other.op} {other.name}{tied}"
    pattern = next((p for p in exclude if fnmatchcase(name, p)), None)
    if pattern is not None:
        return f"excluded by pattern {pattern!r}"
    shape = graph.weights[name].shape
    if len(shape) != 2:
        return f"not a 2-D weight: shape {shape}"
    return ""
