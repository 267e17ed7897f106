"""How fast this machine streams memory through ONNX Runtime's CPU kernels: ReduceSum over a float32 tensor
(1 GiB by default), the read a bandwidth-bound batch-1 decode does with its weights, median of the timed calls.

`python -m tools.bench.read_bandwidth [--mib 1024] [--threads 2] [--calls 7]`: the yardstick beside the decode
tables' "GB/s of weights" column (docs/BENCHMARKS.md, "Mixture of experts beside llama.cpp")."""
from __future__ import annotations

import statistics
import time

import click
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper


def read_gb_s(mib: int, threads: int, calls: int) -> list[float]:
    """GB/s of each timed ReduceSum call over `mib` MiB (two warm-up calls first)."""
    n = mib * 2**20 // 4
    graph = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "read",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.ones(n, np.float32)
    rates = []
    for i in range(calls + 2):
        start = time.perf_counter()
        session.run(None, {"x": x})
        if i >= 2:
            rates.append(x.nbytes / (time.perf_counter() - start) / 1e9)
    return rates


@click.command()
@click.option("--mib", default=1024, show_default=True, type=click.IntRange(1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(1))
@click.option("--calls", default=7, show_default=True, type=click.IntRange(1))
def main(mib: int, threads: int, calls: int) -> None:
    rates = read_gb_s(mib, threads, calls)
    click.echo(f"ReduceSum over {mib} MiB, {threads} threads: median {statistics.median(rates):.1f} GB/s, "
               f"best {max(rates):.1f} GB/s ({calls} calls)")


if __name__ == "__main__":
    main()
