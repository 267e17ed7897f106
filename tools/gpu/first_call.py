"""Where a call shape's first run goes (docs/GPU.md: 61-77 ms on an H100 against 2.6 ms steady, batch-1 prefill of
the 1B shape). Each variant loads the engine in a process of its own (some are environment variables read when CUDA
starts) and times, per prompt length: binding the call's buffers alone (`_Call`), its first run, the steady run,
the same length on another KV row (new buffers, an ORT shape already seen) and one token longer (a new ORT shape):

    python -m tools.gpu.first_call --engine ENGINE --device cuda --out DIR

Variants: `default` (as the runtime loads, prompt buckets off), `no-graphs` (a session without enable_cuda_graph),
`eager-modules` (CUDA_MODULE_LOADING=EAGER: every kernel loaded when CUDA starts), `no-mem-pattern` (ORT's memory
pattern planning off), `buckets` (prompt buckets on: each length's first run after the warm-up at load), and
`profile` (ORT's profiler over a new shape's first and second run, after another shape warmed the session:
where the time goes, by op)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import click

VARIANTS = {"default": {}, "no-graphs": {}, "eager-modules": {"CUDA_MODULE_LOADING": "EAGER"},
            "no-mem-pattern": {}, "buckets": {}, "profile": {}}
REPEATS = 5


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (7 * j + salt) % 200 for j in range(n)]


def measure(llm, lengths: list[int]) -> list[dict]:
    """Per length: ms to bind the call alone, its first run, steady (median), the same length on row 1, and one
    token longer on row 0. With prompt buckets the call's length is the bucket's and its binding may exist."""
    runner, rows = llm.runner, []
    for n in lengths:
        seq = runner.padded(0, n)
        key = (0, 1, seq, 1, "logits", 0)  # the CallCache key: no features
        bind = _seconds(lambda: runner._call(*key)) if key not in runner._calls else 0.0
        first = _seconds(lambda: runner.prefill(0, [_prompt(n)]))
        steady = statistics.median(_seconds(lambda: runner.prefill(0, [_prompt(n)])) for _ in range(REPEATS))
        other_row = _seconds(lambda: runner.prefill(1, [_prompt(n)]))
        longer = _seconds(lambda: runner.prefill(0, [_prompt(n + 1)]))
        rows.append({"length": n, "bind_ms": bind * 1e3, "first_ms": first * 1e3, "steady_ms": steady * 1e3,
                     "other_row_ms": other_row * 1e3, "one_longer_ms": longer * 1e3})
    return rows


def profile_summary(path: Path, top: int = 8) -> dict:
    """ORT's profile of the runs it holds, summed per op for the first and the second run (Node events inside
    each model_run window): where a first run's extra time goes, and how much is outside every node."""
    events = json.loads(path.read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    out = []
    for lo, hi in runs[-2:]:
        ops, nodes = defaultdict(float), []
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and lo <= e["ts"] <= hi:
                ops[e.get("args", {}).get("op_name", "?")] += e["dur"] / 1e3
                nodes.append((e["dur"] / 1e3, e["name"]))
        out.append({"run_ms": (hi - lo) / 1e3, "nodes_ms": sum(ops.values()),
                    "ops_ms": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:top]),
                    "slowest_nodes": [[round(d, 3), name] for d, name in sorted(nodes, reverse=True)[:top]]})
    return {"first": out[0], "second": out[1]} if len(out) == 2 else {"runs": out}


def run_variant(engine: Path, device: str, variant: str, lengths: list[int]) -> dict:
    """One variant in this process (its environment already set by the parent)."""
    from runtime.engine import LLM
    from runtime.model import model_runner, ort_session

    options = {"device": device, "prompt_buckets": variant == "buckets"}
    if variant == "no-graphs":
        options["graph_decode"] = False
    made = ort_session.session_options
    profile_dir = Path(tempfile.mkdtemp(prefix="first-call-"))

    def patched(threads, spinning=True):
        chosen = made(threads, spinning)
        if variant == "no-mem-pattern":
            chosen.enable_mem_pattern = False
        if variant == "profile":
            chosen.enable_profiling = True
            chosen.profile_file_prefix = str(profile_dir / "ort")
        return chosen

    model_runner.session_options = patched
    start = time.perf_counter()
    llm = LLM(engine, **options)
    result = {"variant": variant, "load_s": time.perf_counter() - start,
              "warmed_shapes": llm.runner.new_call_shapes}
    try:
        if variant == "profile":  # the session's first runs pay what every kernel's first use costs: warm one
            n = lengths[len(lengths) // 2]  # shape first, so the profile's last two runs are a NEW shape's first
            for length in (n - 1, n - 1, n, n):  # run and its second
                llm.runner._call(0, 1, length, 1, "logits")
                llm.runner.prefill(0, [_prompt(length)])
            result["profile"] = profile_summary(Path(llm.runner.session.end_profiling()))
            result["profile"]["length"] = n
        else:
            result["rows"] = measure(llm, lengths)
    finally:
        llm.close()
    return result


def run_variants(engine: Path, device: str, lengths: list[int], variants: list[str]) -> list[dict]:
    """Each variant in a child process of its own (its environment set before CUDA starts), printed as it ends."""
    results = []
    for variant in variants:
        command = [sys.executable, "-m", "tools.gpu.first_call", "--engine", str(engine), "--device", device,
                   "--lengths", ",".join(map(str, lengths)), "--one", variant]
        env = {**os.environ, **VARIANTS[variant]}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
            last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
            results.append(json.loads(last) if done.returncode == 0 and last.startswith("{") else
                           {"variant": variant, "error": f"exit {done.returncode}: {done.stderr[-600:]}"})
        except subprocess.TimeoutExpired:
            results.append({"variant": variant, "error": "timed out after 120 s"})
        print(table(results[-1:]), flush=True)
    return results


def table(results: list[dict]) -> str:
    lines = []
    for r in results:
        head = f"{r['variant']}: load {r.get('load_s', 0):.1f} s, {r.get('warmed_shapes', 0)} shapes at load"
        if "error" in r:
            lines.append(f"{head}: FAILED {r['error']}")
            continue
        lines.append(head)
        for row in r.get("rows", []):
            lines.append("  length {length:4d}: bind {bind_ms:6.2f}  first {first_ms:7.2f}  steady {steady_ms:6.2f}  "
                         "other row {other_row_ms:7.2f}  one longer {one_longer_ms:7.2f} ms".format(**row))
        if "profile" in r:
            p = r["profile"]
            for which in ("first", "second"):
                if which in p:
                    run = p[which]
                    ops = ", ".join(f"{k} {v:.2f}" for k, v in run["ops_ms"].items())
                    lines.append(f"  profile {which} run (length {p['length']}): {run['run_ms']:.2f} ms, nodes "
                                 f"{run['nodes_ms']:.2f} ms: {ops}")
                    lines.append(f"    slowest: {run['slowest_nodes'][:4]}")
    return "\n".join(lines)


@click.command()
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--device", default="cuda", show_default=True)
@click.option("--lengths", default="16,64,256", show_default=True, help="Prompt lengths, comma-separated.")
@click.option("--variant", "variants", multiple=True, type=click.Choice(list(VARIANTS)),
              help="Variants to run (default: all).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write first_call.json and the table here.")
@click.option("--one", type=click.Choice(list(VARIANTS)), default=None, hidden=True)
def main(engine: Path, device: str, lengths: str, variants: tuple[str, ...], out: Path | None, one: str | None):
    sizes = [int(x) for x in lengths.split(",")]
    if one is not None:  # the child: one variant, its result as the last line of stdout
        print(json.dumps(run_variant(engine, device, one, sizes)), flush=True)
        return
    results = run_variants(engine, device, sizes, list(variants or VARIANTS))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "first_call.json").write_text(json.dumps(results, indent=1))
        (out / "first_call.txt").write_text(table(results) + "\n")


if __name__ == "__main__":
    main()
