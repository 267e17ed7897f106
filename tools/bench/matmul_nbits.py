"""MatMulNBits alone, the way a decode step runs its linears: a model's weight shapes, each repeated `copies`
times with its own random weights (so the sweep streams from memory as a model's layers do), quantized by the
builder's own quantizer, one session per shape, median of the timed runs; prints ms per sweep and the GB/s of
quantized bytes it read.

`python -m tools.bench.matmul_nbits --shapes smollm2 --config 4:32:4:sym --config 4:64:4:sym --m 1,8`

A config is bits:block:accuracy_level:sym|asym; bits `4+2` is a 6-bit weight as two MatMulNBits on the same input,
a 4-bit and a 2-bit part, summed by an Add (issue 47: Q5/Q6 types split exactly instead of carried as 8 bits; random
codes, default zero points). Shape sets: `smollm2` (one decoder layer of SmolLM2-135M:
qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, 30 copies), `smollm2-head` (the tied 49152x576
lm_head, 1 copy), `1b` (Llama-3.2-1B's layer: qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192,
2 copies), `7b` (4096x4096, 11008x4096, 4096x11008, 4 copies). docs/BENCHMARKS.md, "int4 and int8 at
batch 1" has what it measured here."""
from __future__ import annotations

import statistics
import time

import click
import numpy as np
import onnxruntime as ort
from onnx import NodeProto, TensorProto, helper, numpy_helper

from builder.quant.schemes import quantize
from tools.bench.measure import int_list

SHAPES = {"smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
          "smollm2-head": ([(49152, 576)], 1),
          "1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 2),
          "7b": ([(4096, 4096), (11008, 4096), (4096, 11008)], 4)}


def quantized_matmul(w: np.ndarray, bits: int, block: int, level: int, symmetric: bool, x: str = "x", y: str = "y",
                     suffix: str = "") -> tuple[NodeProto, list[TensorProto], int]:
    """y = x W^T as one MatMulNBits node on W [N, K] quantized by the builder's quantizer: (node, its weight
    initializers q/s/z + suffix, their bytes)."""
    arrays = quantize(w, bits, block, symmetric)
    inputs = [x, f"q{suffix}", f"s{suffix}"] + ([f"z{suffix}"] if arrays.zero_points is not None else [])
    weights = [numpy_helper.from_array(array, name)
               for name, array in zip(inputs[1:], (arrays.q, arrays.scales, arrays.zero_points))]
    node = helper.make_node("MatMulNBits", inputs, [y], domain="com.microsoft", K=w.shape[1], N=w.shape[0],
                            bits=bits, block_size=block, accuracy_level=level)
    return node, weights, sum(t.nbytes for t in (arrays.q, arrays.scales, arrays.zero_points) if t is not None)


def random_codes_matmul(n: int, k: int, bits: int, block: int, level: int, rng: np.random.Generator, x: str, y: str,
                        suffix: str) -> tuple[NodeProto, list[TensorProto], int]:
    """y = x W^T as one MatMulNBits node of random packed codes (any bits), float32 scales, default zero points."""
    q = rng.integers(0, 256, (n, k // block, block * bits // 8), dtype=np.uint8)
    s = rng.uniform(0.001, 0.01, (n, k // block)).astype(np.float32)
    weights = [numpy_helper.from_array(q, f"q{suffix}"), numpy_helper.from_array(s, f"s{suffix}")]
    node = helper.make_node("MatMulNBits", [x, f"q{suffix}", f"s{suffix}"], [y], domain="com.microsoft", K=k, N=n,
                            bits=bits, block_size=block, accuracy_level=level)
    return node, weights, q.nbytes + s.nbytes


def split_matmul(n: int, k: int, block: int, level: int, rng: np.random.Generator, y: str,
                 suffix: str) -> tuple[list[NodeProto], list[TensorProto], int]:
    """A 6-bit weight as a 4-bit and a 2-bit MatMulNBits on the same input, their outputs added."""
    low, low_w, low_bytes = random_codes_matmul(n, k, 4, block, level, rng, "x", f"{y}_low", f"{suffix}_low")
    high, high_w, high_bytes = random_codes_matmul(n, k, 2, block, level, rng, "x", f"{y}_high", f"{suffix}_high")
    return [low, high, helper.make_node("Add", [f"{y}_low", f"{y}_high"], [y])], low_w + high_w, low_bytes + high_bytes


def session(n: int, k: int, bits: int | str, block: int, level: int, symmetric: bool, copies: int,
            threads: int) -> tuple[ort.InferenceSession, int]:
    """A graph of `copies` MatMulNBits nodes [M, k] x [n, k]^T on one input (or, bits "4+2", `copies` pairs and
    their Adds), and the quantized bytes they read."""
    rng = np.random.default_rng(0)
    nodes, weights, nbytes = [], [], 0
    for c in range(copies):
        if bits == "4+2":
            made, inits, size = split_matmul(n, k, block, level, rng, f"y{c}", str(c))
        else:
            node, inits, size = quantized_matmul(rng.standard_normal((n, k)).astype(np.float32), bits, block, level,
                                                 symmetric, y=f"y{c}", suffix=str(c))
            made = [node]
        nodes += made
        weights += inits
        nbytes += size
    graph = helper.make_graph(nodes, "linears", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info(f"y{c}", TensorProto.FLOAT, ["M", n])
                               for c in range(copies)], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), nbytes


def sweep_ms(shapes: str, bits: int | str, block: int, level: int, symmetric: bool, m: int, threads: int,
             runs: int, clock=time.perf_counter) -> tuple[float, int]:
    """(median ms of one sweep over every shape's copies, quantized bytes read), by `clock`."""
    total_s, total_bytes = 0.0, 0
    pairs, copies = SHAPES[shapes]
    for n, k in pairs:
        sess, nbytes = session(n, k, bits, block, level, symmetric, copies, threads)
        x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
        for _ in range(3):
            sess.run(None, {"x": x})
        times = []
        for _ in range(runs):
            start = clock()
            sess.run(None, {"x": x})
            times.append(clock() - start)
        total_s += statistics.median(times)
        total_bytes += nbytes
    return total_s * 1e3, total_bytes


def parse_config(text: str) -> tuple[int | str, int, int, bool]:
    try:
        bits, block, level, sym = text.split(":")
        if sym not in ("sym", "asym"):
            raise ValueError
        return (bits if bits == "4+2" else int(bits)), int(block), int(level), sym == "sym"
    except ValueError:
        raise click.BadParameter(f"{text!r}: give bits:block:accuracy_level:sym|asym, e.g. 4:32:4:sym") from None


@click.command()
@click.option("--shapes", type=click.Choice(sorted(SHAPES)), default="smollm2", show_default=True)
@click.option("--config", "configs", multiple=True, default=("4:32:4:sym",), show_default=True,
              help="bits:block:accuracy_level:sym|asym, repeatable; bits 4+2: the split pair")
@click.option("--m", "ms", default="1,8", show_default=True, help="Rows of the activation (batch), comma-separated.")
@click.option("--threads", default=2, show_default=True)
@click.option("--runs", default=15, show_default=True)
@click.option("--cpu-time", is_flag=True, help="Time by the process's CPU time, not the wall clock: with --threads 1 "
              "it holds up on a shared machine (with more, ONNX Runtime's spinning threads count too).")
def main(shapes: str, configs: tuple[str, ...], ms: str, threads: int, runs: int, cpu_time: bool) -> None:
    clock = time.process_time if cpu_time else time.perf_counter
    for config in configs:
        bits, block, level, symmetric = parse_config(config)
        for m in int_list(ms):
            ms_, nbytes = sweep_ms(shapes, bits, block, level, symmetric, m, threads, runs, clock)
            click.echo(f"{shapes} {config} M {m}: {ms_:.2f} ms, {nbytes / 1e6:.1f} MB, {nbytes / ms_ / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
