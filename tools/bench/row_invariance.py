"""Does an op round one row like it rounds the same row among several? The question behind quantized
speculation (docs/ACCURACY.md, "Quantized speculation"): a verify call scores several positions at once,
plain decoding one. For float32 MatMul and MatMulNBits at each bits / accuracy level / symmetry, prints the
largest difference between rows run one at a time and run 8 at once, and between 2, 3 or 5 rows and 8.

    python -m tools.bench.row_invariance [--n 1536] [--k 576] [--threads 2]
"""
from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tools.bench.matmul_nbits import quantized_matmul

ROWS = 8


def session(node, inits, k: int, n: int, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def matmul_nbits(w: np.ndarray, bits: int, block: int, level: int, symmetric: bool, threads: int):
    node, inits, _ = quantized_matmul(w, bits, block, level, symmetric, "X", "Y")
    return session(node, inits, w.shape[1], w.shape[0], threads)


def differences(s: ort.InferenceSession, x: np.ndarray) -> tuple[float, float]:
    """(one row at a time against all at once, 2/3/5 rows against all at once): largest |difference|."""
    full = s.run(None, {"X": x})[0]
    one = np.concatenate([s.run(None, {"X": x[i:i + 1]})[0] for i in range(len(x))])
    some = max(float(np.abs(s.run(None, {"X": x[:m]})[0] - full[:m]).max()) for m in (2, 3, 5))
    return float(np.abs(one - full).max()), some


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.n, args.k)).astype(np.float32)
    x = rng.standard_normal((ROWS, args.k)).astype(np.float32)
    print(f"onnxruntime {ort.__version__}, N {args.n}, K {args.k}, {args.threads} threads")
    print("| op | 1 row vs 8 | 2/3/5 rows vs 8 | |Y| max |")
    print("|---|---|---|---|")
    mm = session(helper.make_node("MatMul", ["X", "W"], ["Y"]), [numpy_helper.from_array(w.T.copy(), "W")],
                 args.k, args.n, args.threads)
    rows = [("float32 MatMul", mm)]
    for bits, block in ((8, 256), (4, 32), (4, 128)):
        for level in (1, 4):
            for symmetric in (True, False):
                label = f"MatMulNBits {bits}-bit block {block} level {level} {'sym' if symmetric else 'asym'}"
                rows.append((label, matmul_nbits(w, bits, block, level, symmetric, args.threads)))
    for label, s in rows:
        one, some = differences(s, x)
        print(f"| {label} | {one:.3g} | {some:.3g} | {float(np.abs(s.run(None, {'X': x})[0]).max()):.3g} |")


if __name__ == "__main__":
    main()
