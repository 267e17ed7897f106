"""Issue 46's steps of the GPU check (tools/gpu/check.py runs them): the CUDA weight-only kernels probed on
single MatMulNBits layers, then the user's headline, `engine-build --recipe build_recipes/llama7b_int8_tp2.yaml`,
on a random checkpoint of the Llama-2-7B shape made on the lent machine (never carried), with its tp1 int8,
fp16 and int4 twins: tp2 against tp1, fp16 against transformers float32, decode tok/s at batch 1 / 8 / 32 with
each kernel choice, and engine-serve under 64 concurrent streams; and a real model on CUDA, SmolLM2 from its GGUF
file (carried in the bundle: `python -m tools.gpu.setup stage --smollm2`) against transformers from the same file.

On CPU (`--device cpu`, the rehearsal CI runs) every step runs the same code on a small Llama in float32:
TensorRT-LLM's kernels are CUDA's, so both kernel choices run ONNX Runtime's CPU kernels there."""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

from tools.gpu import steps as m

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "build_recipes" / "llama7b_int8_tp2.yaml"
SMALL = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=768, vocab_size=1000)
TWINS = {  # engine name -> (overrides of the headline recipe); the recipe as written first
    "int8-tp2": (),
    "int8-tp1": ("parallel.tensor_parallel=1",),
    "fp16-tp1": ("parallel.tensor_parallel=1", "quantization.mode=none"),
    "int4-tp1": ("parallel.tensor_parallel=1", "quantization.mode=int4_rtn", "quantization.group_size=128"),
}
BATCHES = (1, 8, 32)
KERNELS = ("ort", "fpa_intb")


def headline_prompts(count: int = 8) -> list[list[int]]:
    """Ragged prompts of token ids every random checkpoint's vocabulary holds."""
    return [[3 + (11 * i + 5 * j) % 900 for j in range(n)] for i, n in enumerate((5, 17, 33, 9, 64, 3, 21, 40)[:count])]


# ---- the kernels alone ---------------------------------------------------------------------------------------

def layer_graph(k: int, n: int, layers: int, bits: int | None, block: int, dtype: str) -> tuple[bytes, list]:
    """An ONNX model y = sum_i x @ W_i.T over `layers` weights [n, k] (MatMulNBits of `bits`, zero point
    2^(bits-1), or a float MatMul when bits is None), and the float32 weights it holds (the reference's)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    elem = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
    np_dtype = np.float16 if dtype == "float16" else np.float32
    nodes, inits, weights, outs = [], [], [], []
    for i in range(layers):
        q = rng.integers(0, 2 ** (bits or 8), (n, k), dtype=np.uint8)
        scales = (rng.uniform(0.5, 1.0, (n, k // block)) / np.sqrt(k) / 2 ** ((bits or 8) - 2)).astype(np_dtype)
        w = ((q.astype(np.float32) - 2 ** ((bits or 8) - 1)).reshape(n, k // block, block)
             * scales.astype(np.float32)[..., None]).reshape(n, k)
        out = f"y{i}"
        if bits is None:
            inits.append(numpy_helper.from_array(w.T.astype(np_dtype), f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [out]))
            weights.append(w.astype(np_dtype).astype(np.float32))
        else:
            codes = q.reshape(n, k // block, block)
            packed = codes if bits == 8 else (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
            inits += [numpy_helper.from_array(packed, f"b{i}"), numpy_helper.from_array(scales, f"s{i}")]
            nodes.append(helper.make_node("MatMulNBits", ["x", f"b{i}", f"s{i}"], [out], domain="com.microsoft",
                                          K=k, N=n, bits=bits, block_size=block, accuracy_level=0))
            weights.append(w)
        outs.append(out)
    nodes.append(helper.make_node("Sum", outs, ["y"]))
    graph = helper.make_graph(nodes, "layers", [helper.make_tensor_value_info("x", elem, ["m", k])],
                              [helper.make_tensor_value_info("y", elem, ["m", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString(), weights


def time_layers(model: bytes, weights: list, device: str, dtype: str, kernels: str, ms: tuple[int, ...],
                repeats: int) -> dict[int, tuple[float, float]]:
    """{M: (seconds per call, relative RMS error against float32)} of `model` on `device` set up for `kernels`
    (runtime/model/weight_kernels.py), inputs and outputs bound on the device (only the kernels are timed)."""
    import onnxruntime as ort

    from runtime.model.device import PROVIDERS, open_session
    from runtime.model.weight_kernels import configure

    options = ort.SessionOptions()
    ran = configure(options, kernels, "auto", device)
    chosen = [PROVIDERS[device]] + (["CPUExecutionProvider"] if device == "cuda" else [])
    session = open_session(model, options, chosen)
    np_dtype = np.float16 if dtype == "float16" else np.float32
    n, results = weights[0].shape[0], {}
    for rows in ms:
        x = (np.random.default_rng(rows).standard_normal((rows, weights[0].shape[1])) * 0.5).astype(np_dtype)
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x, device, 0))
        y = ort.OrtValue.ortvalue_from_shape_and_type([rows, n], np_dtype, device, 0)
        binding.bind_ortvalue_output("y", y)
        times = []
        for _ in range(repeats + 3):
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            times.append(time.perf_counter() - start)
        want = sum(x.astype(np.float32) @ w.T for w in weights)
        got = y.numpy().astype(np.float32)
        error = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))
        results[rows] = (statistics.median(times[3:]), error)
    assert ran == kernels or device != "cuda", f"asked for {kernels}, the session was set up for {ran}"
    return results


def weight_kernels(plan, r) -> None:
    """int4 and int8 MatMulNBits with ONNX Runtime's kernels and with TensorRT-LLM's fpA_intB, blocks 32 and
    128, against a float MatMul, at the 7B shape's 4096 x 4096 layers (16 at once: 128-512 MB of weights a call),
    M = 1 / 8 / 32; GB/s of weights read (the copy roofline: the bandwidth step's figure)."""
    k, n, layers = (4096, 4096, 16) if plan.gpu else (256, 256, 4)
    repeats = 20 if plan.gpu else 3
    float_model, float_weights = layer_graph(k, n, layers, None, 32, plan.dtype)
    base = time_layers(float_model, float_weights, plan.device, plan.dtype, "ort", BATCHES, repeats)
    for rows, (seconds, _) in base.items():
        r.add(f"{plan.dtype} MatMul M{rows} us/layer", seconds / layers * 1e6,
              f"{layers * k * n * (2 if plan.gpu else 4) / seconds / 1e9:.0f} GB/s of weights", key=f"float_m{rows}")
    for bits in (4, 8):
        for block in (32, 128):
            model, weights = layer_graph(k, n, layers, bits, block, plan.dtype)
            for kernels in KERNELS:
                try:
                    timed = time_layers(model, weights, plan.device, plan.dtype, kernels, BATCHES, repeats)
                except Exception as error:  # noqa: BLE001 (a kernel the build lacks is this row's result)
                    r.add(f"int{bits} block {block} {kernels}", "error", str(error)[:200])
                    continue
                for rows, (seconds, err) in timed.items():
                    r.verdict(f"int{bits} b{block} {kernels} M{rows} us/layer", err < 0.02, f"{seconds / layers * 1e6:.1f}",
                              f"{base[rows][0] / seconds:.2f}x {plan.dtype}; rel. error {err:.1e}")
                    r.result["values"][f"int{bits}_b{block}_{kernels}_m{rows}"] = seconds / layers


# ---- the headline ------------------------------------------------------------------------------------------------

def checkpoint(plan) -> Path:
    return plan.work / ("llama7b" if plan.gpu else "llama-small")


def headline_ckpt(plan, r) -> None:
    """The Llama-2-7B-shape checkpoint (random bf16, 13.5 GB) written on the machine, tensor by tensor."""
    from tools.checkpoints.make_large_checkpoint import make_large_checkpoint

    path = checkpoint(plan)
    start = time.perf_counter()
    if not (path / "model.safetensors").exists():
        make_large_checkpoint(path, **({} if plan.gpu else SMALL))
    r.add("make checkpoint s", time.perf_counter() - start, f"{sum(f.stat().st_size for f in path.iterdir()) / 1e9:.1f} GB")


def build_command(plan, name: str, out: Path) -> list[str]:
    """engine-build of the headline recipe as written (the checkpoint's path set), with `name`'s overrides; on
    CPU float32 (the rehearsal)."""
    where = () if plan.gpu else ("target.device=cpu", "target.dtype=float32")
    sets = [f"model={checkpoint(plan)}", "limits.max_seq_len=1024", *where, *TWINS[name]]
    return [sys.executable, "-m", "builder.cli", "--recipe", str(RECIPE), "--out", str(out)] + \
        [arg for s in sets for arg in ("--set", s)]


def headline_build(plan, r) -> None:
    """The four engines built at once, each in a process of its own (16 cores there; the builder streams weights,
    ~1.7 GB each): wall time, and the peak RSS of the largest."""
    todo = {name: plan.engine(f"llama-{name}") for name in TWINS if not (plan.engine(f"llama-{name}") / "manifest.json").exists()}
    start = time.perf_counter()
    procs = {name: subprocess.Popen(build_command(plan, name, out), cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True) for name, out in todo.items()}
    for name, proc in procs.items():
        _, err = proc.communicate()
        r.verdict(f"build {name} s", proc.returncode == 0, f"{time.perf_counter() - start:.0f}",
                  err.strip().splitlines()[-1][:200] if proc.returncode else "concurrent with the others")
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    r.add("largest build's peak RSS GB", peak_gb, f"{len(procs)} built here, {len(TWINS) - len(procs)} before")


def headline_tp(plan, r) -> None:
    """The recipe's tp2 int8 engine, both ranks on the one GPU (gloo), against tp1: identical greedy tokens."""
    from runtime.engine import LLM

    prompts, tokens = headline_prompts(), {}
    with mock.patch.dict(os.environ, {"ENGINE_TP_BACKEND": "gloo"}):
        for name in ("int8-tp1", "int8-tp2"):
            llm = LLM(plan.engine(f"llama-{name}"), device=plan.device)
            try:
                tokens[name] = m.greedy(llm, prompts, plan.new_tokens)
            finally:
                llm.close()
    verdict = m.agreement(tokens["int8-tp1"], tokens["int8-tp2"])
    r.verdict("int8 tp2 (one GPU, gloo) vs tp1, 8 prompts", verdict == "identical", verdict)


def headline_parity(plan, r) -> None:
    """The fp16 tp1 engine against transformers float32 on the GPU (tools/bench/parity.py's rule)."""
    from tools.gpu.check import _greedy_vs_transformers

    _greedy_vs_transformers(plan, r, checkpoint(plan), plan.engine("llama-fp16-tp1"), headline_prompts(4),
                            f"7B-shape {plan.dtype}" if plan.gpu else f"small {plan.dtype}")


def headline_decode(plan, r) -> None:
    """Decode tok/s at batch 1 / 8 / 32 (prompt 16, prefill excluded): fp16, then int8 and int4 with each kernel
    choice; the share of the copy roofline (weights read once a step) and the speedup on fp16."""
    from runtime.engine import LLM

    gb_s = r.report.value("bandwidth", "gb_s")
    for name in ("fp16-tp1", "int8-tp1", "int4-tp1"):
        engine = plan.engine(f"llama-{name}")
        roofline = gb_s * 1e9 / sum(f.stat().st_size for f in engine.glob("*.onnx.data")) if gb_s else None
        for kernels in (("ort",) if name.startswith("fp16") else KERNELS):
            llm = LLM(engine, device=plan.device, max_batch_size=max(BATCHES), weight_kernels=kernels)
            try:
                for batch in BATCHES:
                    tok_s = m.decode_tok_s(llm, batch, plan.new_tokens, plan.repeats)
                    fp = r.result["values"].get(f"fp16-tp1_ort_b{batch}")
                    r.add(f"{name} {kernels} batch {batch} tok/s", tok_s,
                          (f"{tok_s / batch / roofline:.0%} of the roofline; " if roofline else "") +
                          (f"{tok_s / fp:.2f}x fp16" if fp else ""), key=f"{name}_{kernels}_b{batch}")
            finally:
                llm.close()


def headline_serve(plan, r) -> None:
    """engine-serve on the recipe's int8 tp2 engine: 64 streaming clients (closed loop, 32 new tokens) for a
    bounded time: tok/s, TTFT p50 / p99, failures (tools/bench/soak.py)."""
    from tools.bench import soak

    engine, clients = plan.engine("llama-int8-tp2"), 64 if plan.gpu else 4
    with mock.patch.dict(os.environ, {"ENGINE_TP_BACKEND": "gloo"}):
        want = soak.expected(engine, plan.new_tokens)
        run = soak.serve_and_load(engine, clients, 60 if plan.gpu else 8, plan.new_tokens, want)
    samples = run["samples"]
    ttft = sorted(s.ttft for s in samples) or [float("nan")]
    tokens = sum(s.tokens for s in samples)
    r.verdict(f"{clients} streaming clients: failed requests", not run["failures"] and run["server_alive_at_end"],
              str(len(run["failures"])), f"{len(samples)} finished; server alive {run['server_alive_at_end']}")
    r.add("served tok/s", tokens / run["wall_s"], f"TTFT p50 {ttft[len(ttft) // 2] * 1e3:.0f} ms, "
          f"p99 {ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] * 1e3:.0f} ms; "
          f"{sum(s.ok for s in samples)} of {len(samples)} equal to the offline answer", key="tok_s")


def smollm2_cuda(plan, r) -> None:
    """SmolLM2-135M-Instruct from its Q4_1 GGUF, built for the device (float16 on CUDA: the file's Q4_1 / Q8_0
    integers as MatMulNBits with the block-minimum term), greedy tokens and first-step logits against
    transformers loaded from the same file (float32, tools/bench/parity.py's rule), decode tok/s at batch 1 / 8."""
    from builder.build import build_engine
    from builder.recipe import load_recipe
    from runtime.engine import LLM
    from tokenizers import Tokenizer
    from tools.gpu.check import _greedy_vs_transformers
    from tools.gpu.setup import SMOLLM2, TARGET

    if plan.gpu:
        gguf = Path(TARGET) / SMOLLM2
    else:
        from tools.checkpoints.fetch import MODELS, fetch

        gguf = fetch(MODELS["smollm2"], ROOT / "checkpoints", log=lambda _: None)
    if not gguf.is_file():
        r.add("smollm2 on the device", "SKIPPED", f"no {gguf}: stage the bundle with --smollm2")
        r.result["status"] = "SKIPPED"
        return
    engine = plan.engine("smollm2")
    start = time.perf_counter()
    if not (engine / "manifest.json").exists():
        recipe = load_recipe(ROOT / "build_recipes" / "smollm2_cpu.yaml", [
            f"model={gguf}", f"target.device={plan.device}", f"target.dtype={plan.dtype}", "verify.enabled=off",
            "limits.max_batch_size=8", "limits.max_seq_len=512",
            *(() if plan.gpu else ("quantization.accuracy_level=0",))])  # CPU: float activations, as CUDA's are
        build_engine(recipe, engine, log=lambda _: None)
    r.add("build smollm2 s", time.perf_counter() - start, f"{plan.dtype} from {gguf.name}")
    tokenizer = Tokenizer.from_file(str(engine / "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in ("The capital of France is", "def fibonacci(n):",
                                                      "Once upon a time, there was", "Water boils at")]
    _greedy_vs_transformers(plan, r, gguf, engine, prompts, f"smollm2 {plan.dtype}")
    llm = LLM(engine, device=plan.device)
    try:
        for batch in (1, 8):
            r.add(f"smollm2 batch {batch} tok/s", m.decode_tok_s(llm, batch, plan.new_tokens, plan.repeats),
                  key=f"batch{batch}")
    finally:
        llm.close()
