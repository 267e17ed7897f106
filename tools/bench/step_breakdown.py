"""Where one decode step's time goes (issue 28): the in-flight executor (LLM's path) against static batching
(the runner in a plain loop), at batch 1 and 16, and the executor's step against the raw runner step.

    python -m tools.bench.step_breakdown ENGINE --batch-sizes 1,16 --tokens 128 --runs 5

Two measurements, in one process:
- Ratio (uninstrumented): the executor's decode step (greedy, LLM.make_sequence + the executor, as
  LLM.generate runs it: decode time / tokens after the first) against the raw runner step (`runner.decode` with
  the same sampling head in a loop), runs alternating, median of `runs`. Target at batch 1: <= 1.15x.
- With --threads 1 also the same ratio in process CPU time (`cpu_ratio`), which holds up on a shared machine.
- Breakdown (instrumented, so a little slower): each phase's time per decode step, the mean over the decode-only
  steps of a run (its parts add up to the step), the run with the median step of `runs`. Phases: schedule,
  prepare (input arrays, writing and binding them; the runner's call around ONNX Runtime), ort
  (run_with_iobinding), head (sampling on the host; the graph's ArgMax/TopK run inside ort), postprocess
  (progress, finish checks, stats), detokenize (text and stop strings), handoff (events to the caller's
  handle) and other (locks, the rest of the step). `caller_wake` is apart: per token, from the executor's
  event to a streaming caller's thread holding it (batch 1). `host_us`: the executor's own work per step on a
  runner that returns at once, in CPU time (robust on a shared machine; compare two revisions with it).

`--one-client ROUNDS` measures engine-bench's C=1 point instead (`one_client`): in-flight against static TPOT on
the same requests, paired within each round, so the machine's slow phases cancel out of the ratio.

`--clients C --runs N` measures engine-bench's concurrency point at C clients instead (`many_clients`): in-flight
and static batching at full load and one stream's TPOT, the three in every round.

`--overlap-modes ROUNDS` measures the executor's step with overlap off, on (one step at a time) and on with steps
run ahead (`lookahead`), each against the raw runner step, all in each round (`overlap_modes`; tools.gpu.check's
step-overlap step runs the same function on CUDA).

Instrumentation reads the executor's per-step records (Executor.add_step_observer: schedule, run, postprocess and
sampling times, made only while someone observes) and wraps the session, the detokenizer and the handles' events
only while measuring (`Phases`), so it costs nothing when off."""
from __future__ import annotations

import json
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import numpy as np

from runtime.batching.executor import RequestHandle
from runtime.request.detokenizer import TextStream
from runtime.request.params import SamplingParams

PHASES = ("schedule", "prepare", "ort", "head", "postprocess", "detokenize", "handoff", "other")
now = time.perf_counter


class Phases:
    """Accumulates seconds per phase over one step by wrapping methods (`wrap`), then closes the step
    (`end_step`): its exclusive times, the step's total and whether it was decode-only."""

    def __init__(self):
        self.stack = ExitStack()
        self.open: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.prefill = False

    def wrap(self, owner, name: str, phase: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = now()
            try:
                return method(*args, **kwargs)
            finally:
                self.open[phase] = self.open.get(phase, 0.0) + now() - start
        self.stack.enter_context(mock.patch.object(owner, name, timed))

    def end_step(self, total: float) -> None:
        t = self.open
        step = {"schedule": t.get("schedule", 0.0), "ort": t.get("ort", 0.0), "head": t.get("head", 0.0),
                "detokenize": t.get("detokenize", 0.0), "handoff": t.get("handoff", 0.0)}
        step["prepare"] = t.get("run", 0.0) - step["ort"] - t.get("run_head", 0.0)
        step["postprocess"] = t.get("postprocess", 0.0) - step["detokenize"] - step["handoff"] - t.get("post_head", 0.0)
        step["head"] += t.get("run_head", 0.0) + t.get("post_head", 0.0)
        step["other"] = total - sum(step.values())
        step["step"] = total
        if not self.prefill:
            self.steps.append(step)
        self.open, self.prefill = {}, False

    def mean(self) -> dict[str, float]:
        """Mean seconds per decode-only step, per phase and in all (`step`)."""
        return {k: statistics.fmean(s[k] for s in self.steps) for k in (*PHASES, "step")}


class _Session:
    """Forwards to an InferenceSession, timing run_with_iobinding as the phase `ort`."""

    def __init__(self, session, phases: Phases):
        self._session, self._phases = session, phases

    def run_with_iobinding(self, *args):
        start = now()
        try:
            return self._session.run_with_iobinding(*args)
        finally:
            self._phases.open["ort"] = self._phases.open.get("ort", 0.0) + now() - start

    def __getattr__(self, name):
        return getattr(self._session, name)


def _instrument_runner(phases: Phases, runner) -> None:
    phases.stack.enter_context(mock.patch.object(runner, "session", _Session(runner.session, phases)))


def inflight_breakdown(llm, batch: int, prompt: list[int], tokens: int, phases: Phases | None = None) -> dict[str, float]:
    """One greedy generation of `batch` copies of `prompt`, `tokens` new tokens each, through the executor;
    the mean decode step's phases in seconds (`phases`: where the steps are recorded)."""
    from runtime.batching import decode

    executor, phases = llm.executor, phases or Phases()

    def observe(record):  # a step, from its plan to the end of its postprocess (the executor's StepRecord)
        phases.open.update(schedule=record.schedule_s, run=record.run_s, postprocess=record.postprocess_s,
                           post_head=record.sample_s)
        phases.prefill = record.prompt_tokens > 0  # a step with a prompt chunk is not decode-only
        phases.end_step(record.total_s)
    with phases.stack:
        _instrument_runner(phases, llm.runner)
        executor.add_step_observer(observe)
        phases.stack.callback(executor.remove_step_observer, observe)
        phases.wrap(TextStream, "push", "detokenize")
        phases.wrap(TextStream, "finish", "detokenize")
        phases.wrap(RequestHandle, "_emit", "handoff")
        phases.wrap(RequestHandle, "_close", "handoff")
        phases.wrap(decode, "draw_candidate", "run_head")
        _generate(llm, batch, prompt, tokens)
    return phases.mean()


def static_breakdown(llm, batch: int, prompt: list[int], tokens: int) -> dict[str, float]:
    """Static batching's loop (tools/engine_bench RunnerBatch): decode every row with the full logits, argmax on
    the host, no detokenizing; the mean step's phases in seconds."""
    runner, phases = llm.runner, Phases()
    ids = runner.prefill(0, [prompt] * batch).argmax(-1)
    past = np.full(batch, len(prompt), dtype=np.int64)
    with phases.stack:
        _instrument_runner(phases, runner)
        for _ in range(tokens - 1):
            start = now()
            logits = runner.decode(0, ids, past)
            phases.open["run"] = now() - start
            mark = now()
            ids = logits.argmax(-1)
            phases.open["run_head"] = now() - mark
            past += 1
            phases.end_step(now() - start)
    return phases.mean()


def _generate(llm, batch: int, prompt: list[int], tokens: int) -> list:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    seqs = [llm.make_sequence(prompt, params) for _ in range(batch)]
    for handle in [llm.executor.submit_sequence(s) for s in seqs]:
        handle.result()
    return seqs


def executor_step(llm, batch: int, prompt: list[int], tokens: int) -> float:
    """Seconds per decode step through the executor: from every row's first token to the last row's end."""
    seqs = _generate(llm, batch, prompt, tokens)
    first = max(s.first_token_time for s in seqs)
    return (max(s.finish_time for s in seqs) - first) / (tokens - 1)


def runner_step(llm, batch: int, prompt: list[int], tokens: int) -> float:
    """Seconds per raw `runner.decode` step with the head the executor uses for greedy rows."""
    runner = llm.runner
    head = "next_token" if runner.has_next_token else "logits"
    ids = runner.prefill(0, [prompt] * batch).argmax(-1)
    past = np.full(batch, len(prompt), dtype=np.int64)
    start = now()
    for _ in range(tokens - 1):
        out = runner.decode(0, ids, past, head)
        ids = out if head == "next_token" else out.argmax(-1)
        past += 1
    return (now() - start) / (tokens - 1)


def cpu_ratio(llm, batch: int, prompt: list[int], tokens: int, runs: int) -> float:
    """With one ONNX Runtime thread (its work on the calling thread, no thread spinning): process CPU seconds of
    a greedy generation through the executor over those of the raw runner loop (a prefill in both), the median
    of `runs` paired ratios. CPU time holds up where other work shares the cores; wall time does not."""
    def cpu(work) -> float:
        start = time.process_time()
        work()
        return time.process_time() - start
    return statistics.median(cpu(lambda: _generate(llm, batch, prompt, tokens))
                             / cpu(lambda: runner_step(llm, batch, prompt, tokens)) for _ in range(runs))


def host_work(tokenizer, batch: int, steps: int = 300, runs: int = 5) -> float:
    """CPU seconds per decode step of the executor's own work (schedule, inputs, postprocess, detokenize,
    hand-off) on a runner that returns at once (tools/fake_runner.py), best of `runs`:
    the host work alone, in a measure that holds up on a shared machine."""
    from runtime.batching.executor import Executor
    from runtime.request.sequence import Sequence
    from tools.bench.kv_overhead import NEW, PROMPT, VOCAB
    from tools.fake_runner import CountingRunner

    best = float("inf")
    for _ in range(runs):
        executor = Executor(CountingRunner(16, PROMPT + NEW, VOCAB, record=False))
        for _ in range(batch):
            seq = Sequence([5, 6, 7], SamplingParams(max_new_tokens=NEW, ignore_eos=True), tokenizer, frozenset())
            executor._handles[seq.id] = RequestHandle(seq, executor)  # stepped here, without its thread
            executor.scheduler.add(seq)
        executor.step()  # the prompts
        start = time.process_time()
        for _ in range(min(steps, NEW - 2)):
            executor.step()
        best = min(best, (time.process_time() - start) / min(steps, NEW - 2))
    return best


def caller_wake(llm, prompt: list[int], tokens: int) -> float:
    """Mean seconds from the executor putting a token's event on a handle to a streaming caller holding it."""
    sent: list[float] = []
    emit = RequestHandle._emit

    def stamped(handle, output):
        sent.append(now())
        emit(handle, output)
    with mock.patch.object(RequestHandle, "_emit", stamped):
        handle = llm.executor.submit_sequence(llm.make_sequence(prompt, SamplingParams(max_new_tokens=tokens,
                                                                                       ignore_eos=True)))
        got = [now() for _ in handle]
    return statistics.fmean(g - s for g, s in zip(got, sent))


def measure(llm, batch_sizes: tuple[int, ...], tokens: int, runs: int, prompt_len: int = 16) -> dict:
    """Per batch size: the ratio (executor / raw runner step, medians of `runs`) and both breakdowns."""
    prompt = [4 + (i * 7) % (llm.manifest.vocab_size - 4) for i in range(prompt_len)]
    out = {}
    for batch in batch_sizes:
        executor_step(llm, batch, prompt, tokens), runner_step(llm, batch, prompt, tokens)  # warm: bind shapes
        pairs = [(executor_step(llm, batch, prompt, tokens), runner_step(llm, batch, prompt, tokens))
                 for _ in range(runs)]
        ex, raw = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        out[batch] = {"executor_step_ms": ex * 1e3, "runner_step_ms": raw * 1e3, "ratio": ex / raw,
                      "in-flight": _median_run([inflight_breakdown(llm, batch, prompt, tokens) for _ in range(runs)]),
                      "static": _median_run([static_breakdown(llm, batch, prompt, tokens) for _ in range(runs)])}
        out[batch]["host_us"] = host_work(llm.tokenizer, batch) * 1e6
        if llm.config.threads == 1:
            out[batch]["cpu_ratio"] = cpu_ratio(llm, batch, prompt, tokens, runs)
    if 1 in batch_sizes:
        out[1]["caller_wake_ms"] = statistics.median(caller_wake(llm, prompt, tokens) for _ in range(runs)) * 1e3
    return out


def one_client(llm, rounds: int, requests: int = 6, prompts: str = "uniform:16:128", outputs: str = "uniform:64:192",
               seed: int = 0) -> dict:
    """engine-bench's C=1 point (prompts uniform 16-128, outputs 64-192, greedy) served one request at a time by
    LLM.generate (in-flight TPOT from each request's metrics) and by engine-bench's static loop (RunnerBatch), the
    two modes back to back within each round, their order alternating: per-round TPOT medians and ratios. This
    machine's speed moves in phases of minutes, so a ratio taken within a round is the one to read."""
    from tools.engine_bench.config import LengthDist
    from tools.engine_bench.drivers import RunnerBatch
    from tools.engine_bench import workloads as wl

    shapes = wl.mixed(requests, LengthDist.parse(prompts), LengthDist.parse(outputs), seed)
    static = RunnerBatch(llm.runner)

    def tpot(mode: str, reqs: list) -> float:
        if mode == "static":
            times = [static([r]) for r in reqs]
            return statistics.median((last[0] - first[0]) / (r.output_len - 1) for r, (first, last) in zip(reqs, times))
        done = [llm.generate([r.prompt], SamplingParams(max_new_tokens=r.output_len, ignore_eos=True))[0] for r in reqs]
        return statistics.median(c.metrics["tpot_s"] for c in done)

    warm = wl.materialize(shapes[:1], llm.manifest.vocab_size, [seed, 99])
    tpot("static", warm), tpot("in-flight", warm)
    out: dict = {"in-flight_ms": [], "static_ms": [], "ratio": []}
    for i in range(rounds):
        reqs = wl.materialize(shapes, llm.manifest.vocab_size, [seed, i])
        order = ("static", "in-flight") if i % 2 == 0 else ("in-flight", "static")
        t = {mode: tpot(mode, reqs) for mode in order}
        out["in-flight_ms"].append(t["in-flight"] * 1e3)
        out["static_ms"].append(t["static"] * 1e3)
        out["ratio"].append(t["in-flight"] / t["static"])
    out["median_ratio"] = statistics.median(out["ratio"])
    return out


def many_clients(llm, clients: int, rounds: int, per_client: int = 3, single: int = 4,
                 prompts: str = "uniform:16:128", outputs: str = "uniform:64:192", seed: int = 0) -> dict:
    """engine-bench's concurrency point (closed loop, `clients` clients with `per_client` requests each, greedy,
    prompts and outputs drawn as engine-bench draws them) served by in-flight batching (engine-bench's `inflight`
    driver) and static batching (`static` over RunnerBatch), and the first `single` requests one at a time, all
    three in every round: per round in-flight / static throughput at full load (while every client has a request
    in flight) and in-flight's TPOT p50 over one stream's. Paired so that the machine's speed phases cancel out."""
    from tools.engine_bench.config import LengthDist
    from tools.engine_bench.drivers import RunnerBatch, inflight, static
    from tools.engine_bench import workloads as wl

    shapes = wl.mixed(clients * per_client, LengthDist.parse(prompts), LengthDist.parse(outputs), seed)
    batch, step_tokens = RunnerBatch(llm.runner), llm.executor_config.max_tokens_per_step
    modes = {"in-flight": lambda reqs: inflight(llm, reqs, clients, max_tokens_per_step=step_tokens),
             "static": lambda reqs: static(batch, reqs, llm.spec.slots, clients),
             "single": lambda reqs: inflight(llm, reqs[:single], 1, max_running=1, max_tokens_per_step=step_tokens)}
    warm = wl.materialize(shapes[:clients], llm.manifest.vocab_size, [seed, 99])
    for run in modes.values():
        run(warm)
    out: dict = {"throughput_ratio": [], "tpot_ratio": [], "in-flight_tok_s": [], "static_tok_s": [],
                 "tpot_ms": [], "single_tpot_ms": []}
    for i in range(rounds):
        reqs = wl.materialize(shapes, llm.manifest.vocab_size, [seed, i])
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        got = {mode: modes[mode](reqs) for mode in order}
        rate = {mode: got[mode].full_load[1] / got[mode].full_load[0] for mode in ("in-flight", "static")}
        tpot = {mode: statistics.median(s.tpot_s for s in got[mode].served) for mode in ("in-flight", "single")}
        out["in-flight_tok_s"].append(rate["in-flight"])
        out["static_tok_s"].append(rate["static"])
        out["throughput_ratio"].append(rate["in-flight"] / rate["static"])
        out["tpot_ms"].append(tpot["in-flight"] * 1e3)
        out["single_tpot_ms"].append(tpot["single"] * 1e3)
        out["tpot_ratio"].append(tpot["in-flight"] / tpot["single"])
    out["median_throughput_ratio"] = statistics.median(out["throughput_ratio"])
    out["median_tpot_ratio"] = statistics.median(out["tpot_ratio"])
    return out


OVERLAP_MODES = {"off": dict(overlap=False), "on": dict(overlap=True, lookahead=1),
                 "ahead": dict(overlap=True)}  # lookahead: its default with overlap


def overlap_modes(engine, batch: int, tokens: int, rounds: int, **load) -> dict:
    """The executor's decode step at `batch` with overlap off, on (one step at a time) and on with steps run ahead,
    each engine loaded once per mode (`load`: LoadConfig fields) and timed against the raw runner step of its own
    session, the three modes in every round: per mode the median step and executor / raw ratio (`executor_ms_M`,
    `runner_ms_M`, `ratio_M`), how many steps ran ahead, and whether the three gave the same greedy tokens."""
    from runtime.engine import LLM

    llms = {mode: LLM(engine, max_batch_size=batch, **load, **options) for mode, options in OVERLAP_MODES.items()}
    try:
        prompt = [4 + (i * 7) % (llms["off"].manifest.vocab_size - 4) for i in range(16)]
        for llm in llms.values():  # warm: bind shapes (capture graphs on CUDA)
            executor_step(llm, batch, prompt, tokens), runner_step(llm, batch, prompt, tokens)
        pairs = {mode: [] for mode in llms}
        for _ in range(rounds):
            for mode, llm in llms.items():
                time.sleep(0.05)  # the last mode's ONNX Runtime threads spin a while after its call: not into this one
                pairs[mode].append((executor_step(llm, batch, prompt, tokens), runner_step(llm, batch, prompt, tokens)))
        out: dict = {}
        for mode, runs in pairs.items():
            out[f"executor_ms_{mode}"] = statistics.median(e for e, _ in runs) * 1e3
            out[f"runner_ms_{mode}"] = statistics.median(r for _, r in runs) * 1e3
            out[f"ratio_{mode}"] = statistics.median(e / r for e, r in runs)
        out["steps_run_ahead"] = llms["ahead"].executor.totals["steps_run_ahead"]
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        outputs = [[c.token_ids for c in llm.generate([prompt] * batch, params)] for llm in llms.values()]
        out["same_tokens"] = all(o == outputs[0] for o in outputs)
        return out
    finally:
        for llm in llms.values():
            llm.close()


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run whose step is the median, in milliseconds."""
    chosen = sorted(runs, key=lambda r: r["step"])[len(runs) // 2]
    return {k: v * 1e3 for k, v in chosen.items()}


def table(results: dict) -> str:
    """A markdown table: one row per (batch, mode), a column per phase (ms per step)."""
    head = "| batch | mode | " + " | ".join(PHASES) + " | step |"
    lines = [head, "|" + "---|" * (len(PHASES) + 3)]
    for batch, r in results.items():
        for mode in ("in-flight", "static"):
            lines.append(f"| {batch} | {mode} | " + " | ".join(f"{r[mode][p]:.4f}" for p in (*PHASES, "step")) + " |")
    ratios = [f"batch {b}: executor {r['executor_step_ms']:.4f} ms / raw runner {r['runner_step_ms']:.4f} ms = "
              f"**{r['ratio']:.3f}x**" + (f" (CPU time, one thread: {r['cpu_ratio']:.3f}x)" if "cpu_ratio" in r else "")
              for b, r in results.items()]
    host = ["executor host work per decode step (CPU time, a runner that returns at once): " + ", ".join(
        f"batch {b} {r['host_us']:.1f} us" for b, r in results.items())]
    wake = [f"caller wake (batch 1, streaming): {results[1]['caller_wake_ms']:.4f} ms per token"] if 1 in results else []
    return "\n".join(lines + [""] + ["; ".join(ratios)] + host + wake)


def main_command():
    import click

    from runtime.engine import LLM
    from tools.bench.measure import int_list

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.argument("engine", type=click.Path(exists=True, file_okay=False))
    @click.option("--batch-sizes", default="1,16", show_default=True)
    @click.option("--tokens", type=click.IntRange(min=3), default=128, show_default=True, help="New tokens per row.")
    @click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True)
    @click.option("--threads", type=click.IntRange(min=1), default=None, help="ONNX Runtime threads (default: its own).")
    @click.option("--json-out", type=click.Path(dir_okay=False), default=None)
    @click.option("--one-client", "one_client_rounds", type=click.IntRange(min=1), default=None,
                  help="Instead: engine-bench's C=1 point, in-flight against static TPOT, this many paired rounds.")
    @click.option("--overlap-modes", "mode_rounds", type=click.IntRange(min=1), default=None,
                  help="Instead: the executor step with overlap off, on, and on with steps run ahead, against the raw "
                       "runner step, this many rounds per batch size.")
    @click.option("--clients", type=click.IntRange(min=2), default=None,
                  help="Instead: engine-bench's concurrency point at this many clients, in-flight against static at "
                       "full load and TPOT against one stream, --runs paired rounds.")
    def cli(engine, batch_sizes, tokens, runs, threads, json_out, one_client_rounds, mode_rounds, clients):
        """Per-step time of the in-flight executor and static batching, phase by phase."""
        sizes = int_list(batch_sizes)
        if mode_rounds:  # loads one engine per mode itself
            results = {b: overlap_modes(engine, b, tokens, mode_rounds, threads=threads) for b in sizes}
            for b, r in results.items():
                click.echo(f"batch {b}: " + "; ".join(
                    f"{m} {r[f'executor_ms_{m}']:.4f} ms ({r[f'ratio_{m}']:.3f}x raw)" for m in OVERLAP_MODES)
                    + f"; raw {r['runner_ms_off']:.4f} ms; {r['steps_run_ahead']} steps ran ahead; tokens "
                    + ("same" if r["same_tokens"] else "DIFFER"))
        else:
            llm = LLM(engine, max_batch_size=clients or max(sizes), threads=threads)
            try:
                if clients:
                    results = many_clients(llm, clients, runs)
                    for name in ("in-flight_tok_s", "static_tok_s", "throughput_ratio", "tpot_ms", "single_tpot_ms",
                                 "tpot_ratio"):
                        click.echo(f"{name + ' per round:':28s} " + ", ".join(f"{x:.3f}" for x in results[name]))
                    click.echo(f"median in-flight / static at full load **{results['median_throughput_ratio']:.3f}x**; "
                               f"median TPOT / one stream **{results['median_tpot_ratio']:.3f}x**")
                elif one_client_rounds:
                    results = one_client(llm, one_client_rounds)
                    click.echo("in-flight TPOT ms per round: " + ", ".join(f"{x:.2f}" for x in results["in-flight_ms"]))
                    click.echo("static TPOT ms per round:    " + ", ".join(f"{x:.2f}" for x in results["static_ms"]))
                    click.echo("in-flight / static per round: " + ", ".join(f"{x:.3f}" for x in results["ratio"])
                               + f"; median **{results['median_ratio']:.3f}x**")
                else:
                    results = measure(llm, sizes, tokens, runs)
                    click.echo(table(results))
            finally:
                llm.close()
        if json_out:
            Path(json_out).write_text(json.dumps(results, indent=2))
    return cli


if __name__ == "__main__":
    main_command()()
