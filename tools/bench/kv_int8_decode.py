"""Decode attention with an int8 KV cache vs a float32 one at a long context, on CPU: one GroupQueryAttention
node (the engine's own lowering: shared past/present buffer, rotary inside, per-channel K/V scales), one new
token per row on top of `--context` cached tokens, median of `--repeats` timed calls after a warm-up.

    python -m tools.bench.kv_int8_decode [--context 4096] [--batch 1,8] [--heads 32 --kv-heads 8 --head-dim 128]

Prints the per-call milliseconds of each and the ratio float32 / int8 (> 1: int8 is faster)."""
from __future__ import annotations

import time

import click
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper


def attention_model(heads: int, kv_heads: int, dim: int, int8: bool) -> bytes:
    cache = TensorProto.INT8 if int8 else TensorProto.FLOAT
    value = helper.make_tensor_value_info
    inputs = [value("qkv", TensorProto.FLOAT, ["b", 1, (heads + 2 * kv_heads) * dim]),
              value("past_key", cache, ["b", kv_heads, "max", dim]), value("past_value", cache, ["b", kv_heads, "max", dim]),
              value("seqlens_k", TensorProto.INT32, ["b"]), value("total", TensorProto.INT32, []),
              value("cos", TensorProto.FLOAT, ["max", dim // 2]), value("sin", TensorProto.FLOAT, ["max", dim // 2])]
    names = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"]
    attrs = {}
    if int8:
        scale = np.full((kv_heads, 1, dim), 0.02, np.float32)
        initializers = [helper.make_tensor(n, TensorProto.FLOAT, scale.shape, scale.ravel()) for n in ("ks", "vs")]
        names += ["", "", "", "ks", "vs"]
        attrs = dict(kv_cache_bit_width=8, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL")
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, **attrs)
    outputs = [value("out", TensorProto.FLOAT, None), value("present_key", cache, None), value("present_value", cache, None)]
    graph = helper.make_graph([node], "decode", inputs, outputs, initializer=initializers if int8 else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    return model.SerializeToString()


def decode_ms(heads: int, kv_heads: int, dim: int, context: int, batch: int, int8: bool, repeats: int) -> float:
    """Median ms of one decode call with `context` cached tokens per row, the cache bound in place."""
    session = ort.InferenceSession(attention_model(heads, kv_heads, dim, int8), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    shape = (batch, kv_heads, context + 1, dim)
    caches = [rng.integers(-100, 100, shape).astype(np.int8) if int8 else rng.standard_normal(shape).astype(np.float32)
              for _ in range(2)]
    angles = np.outer(np.arange(context + 1), 10000.0 ** (-np.arange(dim // 2) / (dim // 2)))
    binding = session.io_binding()
    feeds = {"qkv": rng.standard_normal((batch, 1, (heads + 2 * kv_heads) * dim)).astype(np.float32),
             "seqlens_k": np.full(batch, context, np.int32), "total": np.array(context + 1, np.int32),
             "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    for kind, cache in zip(("key", "value"), caches):
        buffer = ort.OrtValue.ortvalue_from_numpy(cache)
        binding.bind_ortvalue_input(f"past_{kind}", buffer)
        binding.bind_ortvalue_output(f"present_{kind}", buffer)
    binding.bind_output("out", "cpu")
    session.run_with_iobinding(binding)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


@click.command()
@click.option("--context", default=4096, show_default=True)
@click.option("--batch", default="1,8", show_default=True)
@click.option("--heads", default=32, show_default=True)
@click.option("--kv-heads", default=8, show_default=True)
@click.option("--head-dim", default=128, show_default=True)
@click.option("--repeats", default=30, show_default=True)
def main(context: int, batch: str, heads: int, kv_heads: int, head_dim: int, repeats: int) -> None:
    for rows in (int(b) for b in batch.split(",")):
        ms = {int8: decode_ms(heads, kv_heads, head_dim, context, rows, int8, repeats) for int8 in (False, True)}
        click.echo(f"batch {rows}, context {context}: float32 KV {ms[False]:.3f} ms, int8 KV {ms[True]:.3f} ms, "
                   f"float32 / int8 = {ms[False] / ms[True]:.2f}x")


if __name__ == "__main__":
    main()
