"""Where a batch-1 decode step of an engine spends ONNX Runtime's CPU time: the engine run through the runtime
with ONNX Runtime's profiler on (its ModelRunner's session options), one greedy request, and every decode call's kernel time summed by
op type, MatMulNBits split by (bits, accuracy_level) from the graph; beside it the bytes a step streams (the
engine's weight file, read once per token at batch 1) against the machine's measured read bandwidth.

    python -m tools.bench.op_profile --engine engines/smollm2 [--tokens 64] [--threads 2] [--bandwidth-gb-s 20]

`--bandwidth-gb-s`: the figure `python -m tools.bench.read_bandwidth` measured (without it, measured here on
512 MiB). Prints one table (markdown rows) and the bound."""
from __future__ import annotations

import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import click


def _node_kinds(engine: Path) -> dict[str, str]:
    """Node name -> 'MatMulNBits b-bit level L' or the op type."""
    import onnx

    model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    kinds = {}
    for node in model.graph.node:
        attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
        kinds[node.name] = (f"MatMulNBits {attrs['bits']}-bit level {attrs['accuracy_level']}"
                            if node.op_type == "MatMulNBits" else node.op_type)
    return kinds


def profile(engine: Path, tokens: int, threads: int) -> tuple[dict[str, float], int, float]:
    """(us per decode step by kind, decode steps, wall tokens/s of the decode)."""
    import runtime.model.model_runner as model_runner
    from runtime import LLM, SamplingParams
    from runtime.config import LoadConfig

    folder = Path(tempfile.mkdtemp(prefix="op_profile_"))
    plain = model_runner.session_options

    def profiled(*args, **kwargs):
        options = plain(*args, **kwargs)
        options.enable_profiling = True
        options.profile_file_prefix = str(folder / "ort")
        return options

    model_runner.session_options = profiled
    try:
        llm = LLM(engine, LoadConfig(threads=threads))
        start = time.perf_counter()
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=tokens, ignore_eos=True))
        wall = time.perf_counter() - start
        llm.close()
        del llm
    finally:
        model_runner.session_options = plain
    import gc

    gc.collect()
    events = [e for f in folder.glob("ort*.json") for e in json.loads(f.read_text())]
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    decode = runs[1:]  # the first run is the prompt's prefill
    kinds = _node_kinds(engine)
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and any(a <= e["ts"] < b for a, b in decode):
            node = e["name"].removesuffix("_kernel_time")
            totals[kinds.get(node, e.get("args", {}).get("op_name", node))] += e["dur"]
    steps = max(len(decode), 1)
    return {kind: us / steps for kind, us in totals.items()}, len(decode), tokens / wall


@click.command()
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--tokens", default=64, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--bandwidth-gb-s", type=float, default=None)
def main(engine: Path, tokens: int, threads: int, bandwidth_gb_s: float | None) -> None:
    per_step, steps, tok_s = profile(engine, tokens, threads)
    total = sum(per_step.values())
    click.echo(f"| kernel | us per decode step | share |\n|---|---|---|")
    for kind, us in sorted(per_step.items(), key=lambda kv: -kv[1]):
        if us / total >= 0.005:
            click.echo(f"| {kind} | {us:.0f} | {us / total:.1%} |")
    click.echo(f"| all kernels | {total:.0f} | {steps} decode steps |")
    if bandwidth_gb_s is None:
        from tools.bench.read_bandwidth import read_gb_s

        bandwidth_gb_s = statistics.median(read_gb_s(512, threads, 5))
    nbytes = (engine / "model.onnx.data").stat().st_size
    bound = bandwidth_gb_s * 1e9 / nbytes
    click.echo(f"bytes per token {nbytes / 1e6:.1f} MB (the weight file, read once a step); read bandwidth "
               f"{bandwidth_gb_s:.1f} GB/s -> bound {bound:.0f} tok/s; kernels {1e6 / total:.0f} steps/s; "
               f"decode wall {tok_s:.1f} tok/s ({tok_s / bound:.0%} of the bound)")


if __name__ == "__main__":
    main()
