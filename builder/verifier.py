"""The IR verifier, run by the pass manager after every pass."""
from __future__ import annotations

from builder.ir import Graph
from builder.ops import OPS


class VerifyError(ValueError):
    """The graph breaks an IR invariant."""


def verify(graph: Graph) -> None:
    """Check ops, arity, attributes, single definition, topological order and weight bookkeeping."""
    defined = {v.name for v in graph.inputs} | set(graph.weights)
    for node in graph.nodes:
        _check_node(node, defined, graph)
        for out in node.outputs:
            if out in defined:
                raise VerifyError(f"{node.name}: value {out!r} is defined twice")
            if out not in graph.values:
                raise VerifyError(f"{node.name}: output {out!r} has no Value (shape/dtype)")
            defined.add(out)
    for out in graph.outputs:
        if out.name not in defined:
            raise VerifyError(f"graph output {out.name!r} is never computed")
    for name, src in graph.weights.items():
        if name not in graph.values:
            raise VerifyError(f"weight {name!r} has no Value (shape/dtype)")
        if tuple(graph.values[name].shape) != tuple(src.shape):
            raise VerifyError(f"weight {name!r}: value shape {graph.values[name].shape} != source {src.shape}")


def _check_node(node, defined: set[str], graph: Graph) -> None:
    schema = OPS.get(node.op)
    if schema is None:
        raise VerifyError(f"{node.name}: unknown op {node.op!r}; known: {sorted(OPS)}")
    if not schema.min_inputs <= len(node.inputs) <= len(schema.inputs):
        raise VerifyError(f"{node.name}: {node.op} takes {schema.min_inputs}..{len(schema.inputs)} inputs, "
                          f"got {len(node.inputs)}")
    if schema.variadic_outputs and not node.outputs:
        raise VerifyError(f"{node.name}: {node.op} has one or more outputs, got none")
    if not schema.variadic_outputs and len(node.outputs) != len(schema.outputs):
        raise VerifyError(f"{node.name}: {node.op} has {len(schema.outputs)} outputs, got {len(node.outputs)}")
    missing = [a for a in schema.attrs if a not in node.attrs]
    if missing:
        raise VerifyError(f"{node.name}: {node.op} lacks attributes {missing}")
    for i in node.inputs:
        if i and i not in defined:
            raise VerifyError(f"{node.name}: input {i!r} is used before it is defined")
    if node.op == "Split":
        _check_split(node, graph)


def _check_split(node, graph: Graph) -> None:
    """One size per output, each output as wide as its size, the sizes adding up to the input's width."""
    sizes = list(node.attrs["sizes"])
    widths = [graph.values[o].shape[-1] for o in node.outputs if o in graph.values]
    if len(sizes) != len(node.outputs) or widths != sizes:
        raise VerifyError(f"{node.name}: Split sizes {sizes} do not match its outputs' widths {widths}")
    if sum(sizes) != graph.values[node.inputs[0]].shape[-1]:
        raise VerifyError(f"{node.name}: Split sizes {sizes} add up to {sum(sizes)}, its input "
                          f"{node.inputs[0]!r} is {graph.values[node.inputs[0]].shape[-1]} wide")
