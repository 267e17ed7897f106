"""The block-minimum term of GGUF's Q4_1 / Q4_K / Q5_1 / Q5_K weights (w = s * c + m; builder/passes/
add_block_minimums.py) in its candidate forms, on a model's linears at batch 1 (issue 47):

    python -m tools.bench.block_minimums [--shapes smollm2] [--m 1] [--rounds 15] [--threads 1]

Forms, each one graph of every linear of the shape set (`tools.bench.matmul_nbits` SHAPES, each copy its own
random 4-bit codes, explicit zero points 0 as Q4_1 is carried), all timed in each round in alternating order,
median process CPU time (with --threads 1 it holds up on a shared machine):
- `none`: the 4-bit MatMulNBits alone (wrong numbers: the bound on any form of the term)
- `reduce`: today's Reshape [.., K/32, 32] + ReduceSum + MatMul with M^T + Add
- `einsum`: Reshape + one Einsum (block sums and the product with M together) + Add
- `symmetric`: MatMulNBits with default zero points (8) instead of explicit zeros, plus today's term: Q4_1 as
  s * (c - 8) + (m + 8 s), exact wherever m + 8 s is (kernel speed only)"""
from __future__ import annotations

import statistics
import time

import click
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tools.bench.matmul_nbits import SHAPES

FORMS = ("none", "reduce", "einsum", "symmetric")
BLOCK = 32


def linear(form: str, n: int, k: int, x: str, y: str, rng: np.random.Generator) -> tuple[list, list]:
    """(nodes, initializers) of y = x @ (s * c + m)^T in `form`."""
    inits = []

    def const(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(array, f"{y}.{name}"))
        return f"{y}.{name}"

    blocks = k // BLOCK
    weights = [x, const("q", rng.integers(0, 256, (n, blocks, BLOCK // 2), dtype=np.uint8)),
               const("s", rng.uniform(0.001, 0.01, (n, blocks)).astype(np.float32))]
    if form != "symmetric":
        weights.append(const("z", np.zeros((n, (blocks + 1) // 2), np.uint8)))
    partial = y if form == "none" else f"{y}.partial"
    nodes = [helper.make_node("MatMulNBits", weights, [partial], domain="com.microsoft", K=k, N=n, bits=4,
                              block_size=BLOCK, accuracy_level=4)]
    if form == "none":
        return nodes, inits
    mins = rng.uniform(-0.1, 0.0, (n, blocks)).astype(np.float32)
    nodes.append(helper.make_node("Reshape", [x, const("shape", np.array([0, 0, -1, BLOCK], np.int64))], [f"{y}.b"]))
    if form == "einsum":
        nodes.append(helper.make_node("Einsum", [f"{y}.b", const("m", mins)], [f"{y}.t"], equation="bsgk,ng->bsn"))
    else:
        nodes += [helper.make_node("ReduceSum", [f"{y}.b", const("axes", np.array([-1], np.int64))], [f"{y}.sums"],
                                   keepdims=0),
                  helper.make_node("MatMul", [f"{y}.sums", const("mt", np.ascontiguousarray(mins.T))], [f"{y}.t"])]
    nodes.append(helper.make_node("Add", [partial, f"{y}.t"], [y]))
    return nodes, inits


def session(form: str, shapes: str, threads: int) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    pairs, copies = SHAPES[shapes]
    nodes, inits, outputs = [], [], []
    for c in range(copies):
        for i, (n, k) in enumerate(pairs):
            made, weights = linear(form, n, k, f"x{i}", f"y{c}_{i}", rng)
            nodes += made
            inits += weights
            outputs.append(helper.make_tensor_value_info(f"y{c}_{i}", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, ["B", "S", k])
              for i, (_, k) in enumerate(pairs)]
    model = helper.make_model(helper.make_graph(nodes, form, inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@click.command()
@click.option("--shapes", type=click.Choice(sorted(SHAPES)), default="smollm2", show_default=True)
@click.option("--m", "rows", default=1, show_default=True, help="Rows (batch) of the activation.")
@click.option("--rounds", default=15, show_default=True)
@click.option("--threads", default=1, show_default=True)
def main(shapes: str, rows: int, rounds: int, threads: int) -> None:
    """Every form in every round, alternating order; median ms of process CPU time per sweep of the linears."""
    sessions = {form: session(form, shapes, threads) for form in FORMS}
    pairs, _ = SHAPES[shapes]
    feeds = {f"x{i}": np.random.default_rng(1).standard_normal((rows, 1, k)).astype(np.float32)
             for i, (_, k) in enumerate(pairs)}
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for form in FORMS:
        for _ in range(3):
            sessions[form].run(None, feeds)
    for r in range(rounds):
        for form in (FORMS if r % 2 == 0 else FORMS[::-1]):
            start = time.process_time()
            sessions[form].run(None, feeds)
            times[form].append(time.process_time() - start)
    base = statistics.median(times["none"])
    for form in FORMS:
        t = statistics.median(times[form])
        click.echo(f"{shapes} M {rows} {form:10s} {t * 1e3:6.2f} ms (min {min(times[form]) * 1e3:.2f}), "
                   f"{(t - base) * 1e3:+.2f} ms over the matmuls alone")


if __name__ == "__main__":
    main()
