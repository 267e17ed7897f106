"""The IR verifier: unknown ops, arity, attributes, definition order, shapes.

Split from the former tests/test_ir_and_passes.py; graphs and the numpy interpreter of the IR
are in tests/graph_helpers.py."""
from __future__ import annotations

import numpy as np
import pytest

from builder.ir import Graph, Node, Value
from builder.verifier import verify, VerifyError
from builder.weights import ArrayWeight
from graph_helpers import F32


def small() -> Graph:
    g = Graph("t")
    x = g.add_input("x", ("n", 4), F32)
    g.add_weight("w", ArrayWeight(np.ones((4, 4), np.float32), "w"))
    y = g.make("Linear", [x, "w"], ("n", 4), F32, out="y")
    g.add_output(y)
    verify(g)
    return g


def test_verifier_rejects_unknown_op():
    g = small()
    g.make("Softmax", ["y"], ("n", 4), F32, out="z")
    with pytest.raises(VerifyError, match="unknown op 'Softmax'.*known: .*'Linear'"):
        verify(g)


@pytest.mark.parametrize("op, inputs, message", [
    ("Linear", ["x"], "Linear takes 2..3 inputs, got 1"),
    ("Linear", ["x", "w", "w", "w"], "Linear takes 2..3 inputs, got 4"),
    ("Add", ["x", "x", "x"], "Add takes 2..2 inputs, got 3"),
])
def test_verifier_rejects_wrong_arity(op, inputs, message):
    g = small()
    g.make(op, inputs, ("n", 4), F32)
    with pytest.raises(VerifyError, match=message):
        verify(g)


def _split(g: Graph, sizes: list[int], widths: list[int]) -> None:
    g.add_node("Split", ["y"], [Value(f"part{i}", ("n", w), F32) for i, w in enumerate(widths)], sizes=sizes)


def test_verifier_accepts_a_split_into_its_sizes():
    g = small()
    _split(g, [1, 3], [1, 3])
    verify(g)


@pytest.mark.parametrize("sizes, widths, message", [
    ([1, 3], [1, 2], r"Split sizes \[1, 3\] do not match its outputs' widths \[1, 2\]"),
    ([1, 1, 2], [1, 3], r"Split sizes \[1, 1, 2\] do not match its outputs' widths \[1, 3\]"),
    ([1, 2], [1, 2], r"Split sizes \[1, 2\] add up to 3, its input 'y' is 4 wide"),
    ([], [], "Split has one or more outputs, got none"),
])
def test_verifier_rejects_a_split_that_does_not_add_up(sizes, widths, message):
    g = small()
    _split(g, sizes, widths)
    with pytest.raises(VerifyError, match=message):
        verify(g)


def test_verifier_accepts_absent_optional_input():
    g = small()
    g.make("Linear", ["x", "w", ""], ("n", 4), F32)
    verify(g)


def test_verifier_rejects_wrong_output_count_and_missing_attrs():
    g = small()
    g.make("SkipRMSNorm", ["x", "x", "w"], ("n", 4), F32, eps=1e-5)
    with pytest.raises(VerifyError, match="SkipRMSNorm has 2 outputs, got 1"):
        verify(g)
    g = small()
    g.make("RMSNorm", ["x", "w"], ("n", 4), F32)
    with pytest.raises(VerifyError, match=r"RMSNorm lacks attributes \['eps'\]"):
        verify(g)


def test_verifier_rejects_use_before_definition():
    g = small()
    g.make("Add", ["y", "later"], ("n", 4), F32)
    g.make("Add", ["y", "y"], ("n", 4), F32, out="later")
    with pytest.raises(VerifyError, match="input 'later' is used before it is defined"):
        verify(g)


@pytest.mark.parametrize("name", ["y", "x", "w"])
def test_verifier_rejects_double_definition(name):
    g = small()
    g.nodes.append(Node("Add", ["y", "y"], [name], {}, "dup"))
    with pytest.raises(VerifyError, match=f"dup: value '{name}' is defined twice"):
        verify(g)


def test_verifier_rejects_uncomputed_output_and_weight_shape_mismatch():
    g = small()
    g.nodes.clear()
    with pytest.raises(VerifyError, match="graph output 'y' is never computed"):
        verify(g)
    g = small()
    g.values["w"] = Value("w", (4, 5), F32)
    with pytest.raises(VerifyError, match=r"weight 'w': value shape \(4, 5\) != source \(4, 4\)"):
        verify(g)
    g = small()
    g.nodes.append(Node("Add", ["y", "y"], ["ghost"], {}, "noval"))
    with pytest.raises(VerifyError, match="output 'ghost' has no Value"):
        verify(g)
