"""The GPU checks and benchmarks for a lent GPU machine, in resumable steps that each end well inside one
10-minute call, each writing its result to OUT/<step>.json as soon as it exists; the table is printed from
whatever results exist.

    python -m tools.bench.gpu_check --out /tmp/gc --step all      # every step not done yet, while --budget-s lasts
    python -m tools.bench.gpu_check --out /tmp/gc --step build    # one step (a later call resumes from the files)
    python -m tools.bench.gpu_check --out /tmp/gc --table         # the table of what is measured so far
    python -m tools.bench.gpu_check --out /tmp/gc --device cpu --tiny --step all   # the same code on CPU (tests)

Each step runs in a child process under its own time limit (STEPS): one that runs over is recorded as TIMEOUT
(the transformers static+compile step as "not measured"), never as passed; a test step whose tests were all
skipped is SKIPPED. Engines and the checkpoint live in OUT/work and are reused by later steps. docs/GPU.md
says how to set up the machine and how many calls the whole run takes."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import click
import numpy as np

from tools.bench import gpu_steps as m
from tools.bench.gpu_steps import ONE_B, TINY, build, tp2_on_one_device

DONE = ("passed", "measured", "SKIPPED")  # a step with one of these is not run again by --step all


@dataclass
class Result:
    """One step's outcome: status (passed | measured | SKIPPED | FAILED | TIMEOUT | not measured), rows of
    (what, figure, note) for the table, values later steps and the table's ratios read."""

    step: str
    status: str
    rows: list[list[str]] = field(default_factory=list)
    values: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, what: str, figure: float | str, note: str = "", key: str | None = None) -> None:
        self.rows.append([what, f"{figure:.1f}" if isinstance(figure, float) else str(figure), note])
        if key is not None and isinstance(figure, float):
            self.values[key] = figure


@dataclass(frozen=True)
class Context:
    """Where results and engines live, and the run's settings (the same for every step of one OUT)."""

    out: Path
    device: str
    tiny: bool
    repeats: int

    @property
    def fp(self) -> str:
        return "float16" if self.device == "cuda" else "float32"

    @property
    def sizes(self) -> tuple[int, int, int]:  # new tokens, concurrent requests, longest prompt
        return (8, 4, 32) if self.tiny else (128, 64, 512)

    def result(self, step: str) -> Result | None:
        path = self.out / f"{step}.json"
        return Result(**json.loads(path.read_text())) if path.exists() else None

    def checkpoint(self) -> Path:
        from tools.checkpoints.make_checkpoint import make_checkpoint

        path = self.out / "work" / "ckpt"
        if not (path / "config.json").exists():
            make_checkpoint(path, **(TINY if self.tiny else ONE_B), initializer_range=0.1, seed=0)
        return path

    def engine(self, label: str) -> Path:
        path = self.out / "work" / label
        if not (path / "manifest.json").exists():
            raise click.ClickException(f"no {label} engine in {path.parent}: run --step build first")
        return path


def run_tests(ctx: Context, result: Result, selection: str) -> None:
    """pytest -m gpu on tests/runtime/test_gpu.py's `selection` checkpoints; SKIPPED when nothing ran."""
    import xml.etree.ElementTree as ET

    report = ctx.out / "work" / f"pytest-{selection}.xml"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.unlink(missing_ok=True)  # a report left by an earlier call must not stand for this one
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-k", selection,
                            "tests/runtime/test_gpu.py", f"--junitxml={report}"])
    if not report.exists():
        result.status = "FAILED"
        result.add(f"pytest -m gpu test_gpu.py -k {selection}", "FAILED", f"pytest exited {code} with no report")
        return
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    # pytest exit 5: nothing collected; any other non-zero exit (a collection error) is a failure
    result.status = "FAILED" if failed or code not in (0, 5) else "SKIPPED" if tests == skipped else "passed"
    result.add(f"pytest -m gpu test_gpu.py -k {selection}", result.status,
               f"{tests - skipped - failed} passed, {failed} failed, {skipped} skipped")


def build_engines(ctx: Context, result: Result) -> None:
    checkpoint = ctx.checkpoint()
    new, requests, longest = ctx.sizes
    for label, quant in ((ctx.fp, "none"), ("int4", "int4_rtn")):
        engine, seconds = build(checkpoint, ctx.out / "work" / label, ctx.device, ctx.fp, quant, max(8, requests),
                                longest + new + 8)
        result.add(f"build {label} s", seconds, "tiny" if ctx.tiny else "1B shape", key=f"build_{label}")


def correctness(ctx: Context, result: Result) -> None:
    """Our engine (batch 4 ragged, graphs on and off) against transformers on the same weights, each prompt
    alone: greedy tokens over the trusted length (tools/bench/parity.py) and the first step's logits."""
    from runtime.engine import LLM
    from runtime.request.params import SamplingParams
    from tools.bench.parity import GAP_EPS, hf_references, logits_close, tokens_agree, trusted_length

    prompts = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate((5, 17, 33, 9))]
    new = ctx.sizes[0] if ctx.tiny else 64
    references = hf_references(ctx.checkpoint(), prompts, new, ctx.device, ctx.fp)
    eps = GAP_EPS[ctx.fp]
    result.status = "passed"
    for graphs in (False, True):
        llm = LLM(ctx.engine(ctx.fp), device=ctx.device, graph_decode=graphs)
        logits = [llm.runner.prefill(0, [p])[0] for p in prompts]  # before generate: slot 0 is free
        ours = llm.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
        llm.close()
        agree = [tokens_agree(r.token_ids, ref, eps) for r, ref in zip(ours, references)]
        close = [logits_close(row, ref, ctx.fp) for row, ref in zip(logits, references)]
        trusted = [trusted_length(ref, eps) for ref in references]
        ok = all(agree) and all(c for c, _ in close)
        result.status = result.status if ok else "FAILED"
        result.add(f"greedy vs transformers, batch 4 ragged, graphs {'on' if graphs else 'off'}",
                   "identical" if ok else "DIFFER", f"trusted tokens {trusted} of {new} (gap eps {eps}); first-step "
                   f"logits max diff {max(d for _, d in close):.3g}")


def memory(ctx: Context, result: Result) -> None:
    figures = m.memory_after_load(ctx.engine(ctx.fp), ctx.device)
    result.add(f"{ctx.fp} memory after load GB", figures["used_gb"], f"weights {figures['weights_gb']:.2f} GB + KV "
               f"{figures['kv_gb']:.2f} GB: {figures['ratio']:.2f}x", key="used_gb")


def bandwidth(ctx: Context, result: Result) -> None:
    result.add("copy bandwidth GB/s", m.copy_bandwidth(ctx.device, (1 << 24) if ctx.tiny else (1 << 30)) / 1e9,
               ctx.device, key="bandwidth_gb_s")


def decode(ctx: Context, result: Result, label: str) -> None:
    from runtime.engine import LLM

    engine = ctx.engine(label)
    weights = sum(f.stat().st_size for f in engine.glob("*.onnx.data"))
    measured = ctx.result("bandwidth")
    roofline = measured.values["bandwidth_gb_s"] * 1e9 / weights if measured else None
    llm = LLM(engine, device=ctx.device)
    for batch in (1, 8):
        rate = m.decode_tok_s(llm, batch, ctx.sizes[0], ctx.repeats)
        note = f"{rate / roofline:.0%} of roofline ({roofline:.0f})" if roofline and batch == 1 else ""
        result.add(f"ours {label} batch {batch} tok/s", rate, note, key=f"batch{batch}")
    llm.close()


def step_overhead(ctx: Context, result: Result) -> None:
    """Issue 28: batch 1 through LLM.generate at >= 90% of the raw (captured-graph) step rate, overlap off, on, and
    on with steps run ahead (the CUDA default)."""
    figures = m.step_overhead(ctx.engine(ctx.fp), ctx.device, ctx.sizes[0], ctx.repeats)
    result.status = "measured" if figures["same_tokens"] else "FAILED"
    for overlap in ("off", "on", "ahead"):
        ours, raw = figures[f"executor_ms_{overlap}"], figures[f"runner_ms_{overlap}"]
        result.add(f"batch 1 executor step us, overlap {overlap}", ours * 1e3, f"raw runner {raw * 1e3:.1f} us: {raw / ours:.0%} "
                   f"of its rate (target >= 90%); tokens {'same' if figures['same_tokens'] else 'DIFFER'}",
                   key=f"executor_{overlap}")


def concurrency(ctx: Context, result: Result) -> None:
    from runtime.engine import LLM

    new, requests, longest = ctx.sizes
    llm = LLM(ctx.engine(ctx.fp), device=ctx.device)
    rate, single, ttft = m.concurrency(llm, requests, new, longest)
    llm.close()
    result.add(f"{requests} concurrent tok/s", rate, f"{rate / single:.1f}x single stream ({single:.1f})", key="rate")
    result.add("TTFT p50 ms", ttft * 1e3, key="ttft_ms")


def tp2(ctx: Context, result: Result) -> None:
    verdict = tp2_on_one_device(ctx.out / "work", ctx.device, ctx.fp)
    result.status = "passed" if verdict == "identical" else "FAILED"
    result.add(f"tp2 ranks on one device (gloo), {ctx.fp}: greedy vs tp1", verdict)


def topk(ctx: Context, result: Result) -> None:
    from tools.bench.topk_cost import topk_cost

    for what, us in topk_cost(ctx.device, 512 if ctx.tiny else 128256).items():
        result.add(f"sampling head {what} us", us)


def paged(ctx: Context, result: Result) -> None:
    """Issue 29: the paged engine through LLM against the GQA engine, on the KV memory of 8 GQA rows: 32
    mixed-length prompts, a quarter sharing a 32-token prefix with the first."""
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 200, 32).tolist()
    lengths = rng.integers(8, ctx.sizes[2] + 1, 32)
    prompts = [(shared if i % 4 == 0 else []) + rng.integers(3, 200, int(n)).tolist() for i, n in enumerate(lengths)]
    verdict, gqa_peak, paged_peak = m.paged_check(ctx.out / "work" / "paged", ctx.checkpoint(), prompts,
                                                  ctx.sizes[0], rows=8)
    result.status = "passed" if verdict == "identical" else "FAILED"
    result.add("paged fp16 vs GQA fp16, greedy through LLM.generate", verdict)
    result.add("most sequences at once on 8 GQA rows' KV: GQA", float(gqa_peak), key="gqa_peak")
    result.add("... paged", float(paged_peak), f"{paged_peak / max(gqa_peak, 1):.1f}x (target 2x)", key="paged_peak")


def transformers(ctx: Context, result: Result, compiled: bool) -> None:
    name = "transformers static+compile" if compiled else "transformers eager"
    for batch in (1, 8):
        rate = m.transformers_tok_s(ctx.checkpoint(), ctx.device, batch, ctx.sizes[0], ctx.repeats, compiled)
        result.add(f"{name} batch {batch} tok/s", rate, key=f"batch{batch}")


# name -> (time limit s, what it runs). Order is the run order of --step all. A new check: a function above
# and one line here.
STEPS: dict[str, tuple[int, Callable[[Context, Result], None]]] = {
    "tests-small": (540, lambda c, r: run_tests(c, r, "small")),
    "tests-1b": (540, lambda c, r: run_tests(c, r, "1b")),
    "build": (420, build_engines),
    "correctness": (420, correctness),
    "memory": (180, memory),
    "bandwidth": (60, bandwidth),
    "decode-fp": (360, lambda c, r: decode(c, r, c.fp)),
    "decode-int4": (360, lambda c, r: decode(c, r, "int4")),
    "step-overlap": (300, step_overhead),
    "concurrency": (420, concurrency),
    "tp2": (300, tp2),
    "topk": (120, topk),
    "paged": (540, paged),  # two engine builds of the checkpoint
    "hf-eager": (360, lambda c, r: transformers(c, r, False)),
    "hf-compile": (480, lambda c, r: transformers(c, r, True)),
}


def run_inline(ctx: Context, name: str) -> Result:
    """Run step `name` in this process and write OUT/<name>.json (a step that raises is FAILED, with why)."""
    result, start = Result(name, "measured"), time.perf_counter()
    try:
        STEPS[name][1](ctx, result)
    except Exception as error:  # noqa: BLE001 (any failure is this step's result, the next steps still run)
        result.status = "FAILED"
        result.add(f"{name} failed", type(error).__name__, str(error)[:300])
    result.seconds = time.perf_counter() - start
    write(ctx, result)
    return result


def run_limited(ctx: Context, name: str, limit_s: int | None = None) -> Result:
    """Run step `name` in a child process under its time limit; past it the step is TIMEOUT (the compiled
    transformers peer "not measured") and what it wrote before stays."""
    limit = limit_s or STEPS[name][0]
    command = [sys.executable, "-m", "tools.bench.gpu_check", "--out", str(ctx.out), "--device", ctx.device,
               "--repeats", str(ctx.repeats), "--inline", name] + (["--tiny"] if ctx.tiny else [])
    try:
        subprocess.run(command, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        status = "not measured" if name == "hf-compile" else "TIMEOUT"
        write(ctx, Result(name, status, [[name, status, f"did not finish within its {limit} s limit"]],
                          seconds=float(limit)))
    return ctx.result(name) or write(ctx, Result(name, "FAILED", [[name, "FAILED", "the step's process died"]]))


def write(ctx: Context, result: Result) -> Result:
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / f"{result.step}.json").write_text(json.dumps(asdict(result), indent=1))
    return result


def table_rows(ctx: Context) -> list[list[str]]:
    """Every result's rows in step order (a missing step: "not run"), then the ratios the results allow."""
    rows = []
    for name in STEPS:
        result = ctx.result(name)
        rows += [[f"{name}: {what}", figure, note] for what, figure, note in result.rows] if result else [
            [f"{name}", "not run", ""]]
    ours, int4 = ctx.result("decode-fp"), ctx.result("decode-int4")
    if ours and int4 and "batch1" in ours.values and "batch1" in int4.values:
        rows.append(["int4 / fp batch 1", f"{int4.values['batch1'] / ours.values['batch1']:.2f}", ""])
    for peer in ("hf-eager", "hf-compile"):
        theirs = ctx.result(peer)
        for batch in ("batch1", "batch8"):
            if ours and theirs and batch in ours.values and batch in theirs.values:
                rows.append([f"ours {ctx.fp} / {peer} {batch}", f"{ours.values[batch] / theirs.values[batch]:.2f}x", ""])
    return rows


def print_table(ctx: Context) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"gpu_check on {ctx.device}{' (tiny)' if ctx.tiny else ''}: {ctx.out}")
    for column in ("measurement", "figure", "note"):
        table.add_column(column, overflow="fold")
    for row in table_rows(ctx):
        table.add_row(*row)
    Console(width=160).print(table)


def settings(out: Path, device: str, tiny: bool, repeats: int) -> Context:
    """The run's settings, recorded in OUT/settings.json by the first call; a later call must agree."""
    ctx = Context(out, device, tiny, repeats)
    path = out / "settings.json"
    wanted = {"device": device, "tiny": tiny, "repeats": repeats}
    if path.exists() and json.loads(path.read_text()) != wanted:
        raise click.UsageError(f"{out} holds results measured with {path.read_text()}; give the same --device/"
                               f"--tiny/--repeats, or another --out")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted))
    return ctx


@click.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder of the results (one JSON per step) and of the engines they share (work/).")
@click.option("--step", "steps", multiple=True, type=click.Choice(["all", *STEPS]),
              help="Step(s) to run; 'all': every step not done yet, in order, while --budget-s lasts.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--tiny", is_flag=True, help="Tiny model and short runs (this tool's own test, on CPU).")
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--budget-s", type=int, default=570, show_default=True,
              help="--step all starts a step only if its time limit still fits in this many seconds.")
@click.option("--limit-s", type=int, default=None, help="Override every step's own time limit (tests).")
@click.option("--redo", is_flag=True, help="Run the named steps again even when done.")
@click.option("--table", "table_only", is_flag=True, help="Only print the table of the results so far.")
@click.option("--inline", type=click.Choice(list(STEPS)), default=None, hidden=True)
def main(out: Path, steps: tuple[str, ...], device: str, tiny: bool, repeats: int, budget_s: int,
         limit_s: int | None, redo: bool, table_only: bool, inline: str | None) -> None:
    """GPU tests, correctness and benchmarks in resumable steps; prints the table of every result so far."""
    ctx = settings(out, device, tiny, repeats)
    if inline:
        run_inline(ctx, inline)
        return
    start = time.monotonic()
    for name in [] if table_only else [s for s in STEPS if "all" in steps] or list(steps):
        done = ctx.result(name)
        if done and done.status in DONE and (not redo or "all" in steps):
            continue
        if "all" in steps and time.monotonic() - start + (limit_s or STEPS[name][0]) > budget_s:
            click.echo(f"stopping before {name}: its limit does not fit in --budget-s; call again to resume")
            break
        result = run_limited(ctx, name, limit_s)
        click.echo(f"{name}: {result.status} in {result.seconds:.0f} s")
    print_table(ctx)


if __name__ == "__main__":
    main()
