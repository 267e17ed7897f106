"""How an engine reads a GPTQ desc_act weight (columns grouped by a permuted g_idx): the measurement behind
builder/passes/permute_activations.py. Per shape, median milliseconds of one MatMulNBits call (int4,
group 128, zero points, 2 threads) three ways, and each one's error against numpy on the same weight:

- `plain`: MatMulNBits on contiguous groups, no permutation (the cost floor; wrong for a permuted weight);
- `gather`: Gather(x, order, axis=-1) then MatMulNBits on the columns sorted by group (what the builder emits);
- `g_idx`: MatMulNBits' own g_idx input [K] over the weight in its original column order (onnxruntime 1.32's
  CPU kernel then wants the zero points as float [N, blocks]: packed uint8 ones are misread, measured).

    python -m tools.bench.desc_act [--shapes 2048x3072,2048x16384,8192x2048] [--rows 1,16]
    python -m tools.bench.desc_act --decode DIR [--rounds 5]

`--decode DIR` instead writes the trained checkpoint as GPTQ 4-bit group 32 twice (without and with desc_act,
tools/checkpoints/write_quantized.py) under DIR, builds both and times greedy decode at batch 1 and 8 in
alternating rounds (tools/bench/measure.py): the whole-engine cost of the Gathers.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import numpy as np

GROUP = 128
TRAINED = Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target"


def session(nodes: list, inits: dict[str, np.ndarray], k: int, n: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(nodes, "desc_act", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                              [numpy_helper.from_array(v, name) for name, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def sessions(k: int, n: int, level: int, rng) -> tuple[dict, np.ndarray]:
    """{way: session} and the float weight [N, K] they all compute with (in original column order)."""
    from onnx import helper

    from builder.quant.schemes import dequantize, pack, quantize, unpack
    from builder.quant.weights import unpermute_columns

    order = rng.permutation(k)
    arrays = quantize(rng.standard_normal((n, k)).astype(np.float32), 4, GROUP, symmetric=False)  # sorted columns
    weight = unpermute_columns(dequantize(arrays, 4, GROUP, k), order)
    codes = unpack(arrays.q, 4, GROUP).reshape(n, k)
    original = pack(unpermute_columns(codes, order).reshape(n, k // GROUP, GROUP), 4)
    g_idx = (np.argsort(order) // GROUP).astype(np.int32)  # the group of each original column
    attrs = dict(K=k, N=n, bits=4, block_size=GROUP, accuracy_level=level, domain="com.microsoft")
    parts = {"s": arrays.scales, "z": arrays.zero_points}
    built = {
        "plain": session([helper.make_node("MatMulNBits", ["x", "B", "s", "z"], ["y"], **attrs)],
                         dict(parts, B=arrays.q), k, n),
        "gather": session([helper.make_node("Gather", ["x", "order"], ["xp"], axis=-1),
                           helper.make_node("MatMulNBits", ["xp", "B", "s", "z"], ["y"], **attrs)],
                          dict(parts, B=arrays.q, order=order.astype(np.int64)), k, n),
        "g_idx": session([helper.make_node("MatMulNBits", ["x", "B", "s", "z", "g"], ["y"], **attrs)],
                         dict(parts, z=unpack(arrays.zero_points, 4, k // GROUP).astype(np.float32), B=original,
                              g=g_idx), k, n),
    }
    return built, weight


def call_ms(sess, x: np.ndarray, repeats: int = 5, calls: int = 20) -> float:
    sess.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            sess.run(None, {"x": x})
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def decode_rounds(workdir: Path, rounds: int) -> None:
    """Paired decode tok/s of a desc_act import against the same checkpoint written without desc_act."""
    from builder.build import build_engine
    from builder.recipe import load_recipe
    from runtime.engine import LLM
    from tools.bench.measure import median_decode_tok_s, synthetic_prompts
    from tools.checkpoints.write_quantized import write_quantized

    llms = {}
    for name, act_order in (("plain", None), ("desc_act", "shared")):
        write_quantized(TRAINED, workdir / name, "gptq", 4, 32, True, keep=False, act_order=act_order)
        recipe = load_recipe(base={"model": str(workdir / name)},
                             overrides=["limits.max_seq_len=256", "limits.max_batch_size=8", "verify.enabled=off"])
        llms[name] = LLM(build_engine(recipe, workdir / f"engine_{name}", log=lambda _: None), max_batch_size=8)
    rng = np.random.default_rng(0)
    for batch in (1, 8):
        prompts = synthetic_prompts(rng, batch, 16, 4096)
        rates: dict[str, list[float]] = {name: [] for name in llms}
        for r in range(rounds):
            for name in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
                rates[name].append(median_decode_tok_s(llms[name], prompts, 64, 1))
        ratios = [d / p for d, p in zip(rates["desc_act"], rates["plain"])]
        click.echo(f"batch {batch}: plain {statistics.median(rates['plain']):.0f} tok/s, desc_act "
                   f"{statistics.median(rates['desc_act']):.0f} tok/s, desc_act/plain per round "
                   f"{[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")


@click.command()
@click.option("--shapes", default="2048x3072,2048x16384,8192x2048", show_default=True, help="KxN, comma-separated")
@click.option("--rows", default="1,16", show_default=True, help="activation rows M, comma-separated")
@click.option("--accuracy-level", "levels", default="4,0", show_default=True)
@click.option("--decode", "workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="a new directory: time whole-engine decode of a desc_act import instead (see above)")
@click.option("--rounds", default=5, show_default=True, help="--decode: alternating rounds per batch size")
def main(shapes: str, rows: str, levels: str, workdir: Path | None, rounds: int) -> None:
    """Time plain / gather / g_idx MatMulNBits per shape, rows and accuracy level."""
    from tools.bench.env import load_average, machine

    click.echo(f"# {machine()}, load {load_average()[0]:.1f}")
    if workdir is not None:
        return decode_rounds(workdir, rounds)
    rng = np.random.default_rng(0)
    for shape in shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for level in (int(v) for v in levels.split(",")):
            built, weight = sessions(k, n, level, rng)
            for m in (int(v) for v in rows.split(",")):
                x = rng.standard_normal((m, k)).astype(np.float32)
                reference = x @ weight.T
                cells = []
                for way, sess in built.items():
                    error = np.abs(sess.run(None, {"x": x})[0] - reference).max() / np.abs(reference).max()
                    cells.append(f"{way} {call_ms(sess, x):.3f} ms (rel. error {error:.1e})")
                click.echo(f"K={k} N={n} level {level} M={m}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
