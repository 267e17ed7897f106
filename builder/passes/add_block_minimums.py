"""AddBlockMinimums: QuantLinear(x, W) whose weight is a GGUF type with a float minimum per block
(w = s * c + m: Q4_1, Q5_1, Q2_K, Q4_K, Q5_K; builder/gguf/repack.py) -> QuantLinear(x, s * c) +
Linear(BlockSum(x), M), M [N, K / block] the minimums: x @ (s*c + m).T summed the other way round.

MatMulNBits' float zero points would carry the minimum exactly too, but are 18-68x slower on the CPU
(../shared/ORT_NOTES.md, MatMulNBits); this form keeps MatMulNBits on its uint8 / default zero points
(+4% at 2048x2048). The term is in the file's own blocks even where MatMulNBits runs the codes re-blocked smaller
(`quantization.activation_block`): M holds one minimum per stored block. Linears that read the same input share one BlockSum (a GGUF file's Q4_K q and k, kept apart
from a Q6_K v, sum their input's blocks once). Runs after QuantizeWeights; a graph without such weights is left
as it is.

Cheaper exact forms measured and not taken (issue 47, ../docs/BENCHMARKS.md "GGUF types against llama.cpp"):
the minimum as a uint8 zero point needs m / s integral (0.27% of SmolLM2's Q4_1 blocks); Q4_1 as symmetric codes
with the minimum moved by 8 s is exact but ONNX Runtime's symmetric kernel is no faster here; the block sums and
the product as one Einsum cost more than Reshape + ReduceSum + MatMul."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from builder.ir import Graph, Node, Value
from builder.pass_manager import Pass
from builder.quant.weights import QuantizedWeight, block_minimums, has_minimums
from builder.weights import WeightSource


class AddBlockMinimums(Pass):
    name = "add_block_minimums"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        sums: dict[tuple[str, int], str] = {}  # (input, block) -> its BlockSum, made once
        for node in [n for n in g.nodes if n.op == "QuantLinear"]:
            q = g.weights[node.inputs[1]]
            if isinstance(q, QuantizedWeight) and has_minimums(q.quantizer.source):
                _add_term(g, node, q.quantizer.source, q.quantizer.block, sums)  # the stored block, not the kernel's
        return g


def _add_term(g: Graph, node: Node, source: WeightSource, block: int, sums: dict[tuple[str, int], str]) -> None:
    """y = QuantLinear(x) becomes y = QuantLinear(x) + BlockSum(x) @ M.T, inserted right after it (the BlockSum
    only with the first linear on x)."""
    x, y = g.values[node.inputs[0]], g.values[node.outputs[0]]
    prefix = node.inputs[1].rsplit(".", 1)[0]
    n, blocks = int(node.attrs["N"]), int(node.attrs["K"]) // block
    mins = g.add_weight(f"{prefix}.block_minimums", BlockMinimums(source, block, (n, blocks)))
    partial = g.fresh(f"{prefix}.scaled_codes")
    g.values[partial] = Value(partial, y.shape, y.dtype)
    node.outputs[0] = partial
    at, made = g.nodes.index(node) + 1, 2
    if (x.name, block) not in sums:
        sums[x.name, block] = g.make("BlockSum", [x.name], x.shape[:-1] + (blocks,), x.dtype, f"{prefix}.block_sums",
                                     block=block)
        made += 1
    term = g.make("Linear", [sums[x.name, block], mins], y.shape, y.dtype, f"{prefix}.minimum_term")
    g.make("Add", [partial, term], y.shape, y.dtype, out=y.name)
    g.nodes[at:at] = [g.nodes.pop() for _ in range(made)][::-1]


@dataclass(eq=False)
class BlockMinimums(WeightSource):
    """The per-block minimums [N, K / block] of a GGUF weight (zeros for fused parts without)."""

    source: WeightSource
    block: int
    size: tuple[int, int]

    def __post_init__(self) -> None:
        self.shape, self.dtype = self.size, "float32"

    def materialize(self) -> np.ndarray:
        return block_minimums(self.source, self.block)

    def __str__(self) -> str:
        return f"block_minimums({self.source})"
