"""What the sampling head's TopK costs against ArgMax, per k, over [rows, vocab] float32 logits on one device:
the measurement behind the default `sampling_head.max_top_k` (builder/recipe.py); on a GPU run it by hand
(`--device cuda`) when time is left after tools.gpu.check.

    python -m tools.bench.topk_cost --device cpu          # median microseconds per call, one line per (rows, op)
"""
from __future__ import annotations

import statistics
import time

import click
import numpy as np

KS = (1, 8, 32, 33, 64)


def head_model(k: int | None, vocab: int) -> bytes:
    """ArgMax (k None) or TopK(k) over a [rows, vocab] float32 input, as an ONNX model."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", vocab])
    if k is None:
        nodes, inits = [helper.make_node("ArgMax", ["x"], ["i"], axis=-1, keepdims=0)], []
        outputs = [helper.make_tensor_value_info("i", TensorProto.INT64, ["rows"])]
    else:
        nodes = [helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=-1)]
        inits = [helper.make_tensor("k", TensorProto.INT64, [1], [k])]
        outputs = [helper.make_tensor_value_info(n, t, ["rows", k]) for n, t in (("v", TensorProto.FLOAT),
                                                                                 ("i", TensorProto.INT64))]
    graph = helper.make_graph(nodes, "head", [x], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def call_us(k: int | None, vocab: int, rows: int, device: str, repeats: int = 7, calls: int = 20) -> float:
    """Median microseconds of one call, the logits already on `device` (bound once through IOBinding)."""
    import onnxruntime as ort

    from runtime.model.device import PROVIDERS, open_session

    session = open_session(head_model(k, vocab), ort.SessionOptions(), [PROVIDERS[device]])
    logits = np.random.default_rng(0).standard_normal((rows, vocab), dtype=np.float32)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(logits, device, 0))
    for name in [o.name for o in session.get_outputs()]:
        binding.bind_output(name, device)
    for _ in range(3):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e6


def topk_cost(device: str, vocab: int = 128256, rows: tuple[int, ...] = (1, 8)) -> dict[str, float]:
    """{"rows R ArgMax" | "rows R TopK k": median us} for every R in `rows` and k in KS."""
    figures = {}
    for r in rows:
        for k in (None, *KS):
            figures[f"rows {r} " + ("ArgMax" if k is None else f"TopK {k}")] = call_us(k, vocab, r, device)
    return figures


@click.command()
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--vocab", type=int, default=128256, show_default=True)
def main(device: str, vocab: int) -> None:
    """Median microseconds per call of ArgMax and TopK k over the logits, batch rows 1 and 8."""
    for what, us in topk_cost(device, vocab).items():
        print(f"{what:>16}: {us:8.1f} us")


if __name__ == "__main__":
    main()
