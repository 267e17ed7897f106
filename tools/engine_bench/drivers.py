"""Ways to serve a list of requests, timed: the engine's in-flight batching executor, and static
batching (batch by batch, each padded to its longest prompt and decoded until its slowest request
finishes) over either the engine's own ModelRunner or transformers' generate.

Requests arrive open loop (at their `arrival_s`) or closed loop (C clients, each sending its next
request when the previous one finishes)."""
from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from runtime.batching.executor import Completion, Executor
from runtime.request.params import SamplingParams
from tools.engine_bench.workloads import Request

now = time.perf_counter
# the executor's KV figures a measurement keeps (runtime/batching/scheduler.py kv_stats)
KV_STATS = ("kv_blocks_total", "kv_waste_ratio_mean", "preemptions", "recomputed_tokens", "prefix_cache_hit_tokens",
            "prefix_cache_queries_tokens", "moved_sequences")


@dataclass
class Served:
    """One request's outcome; times in seconds from its arrival."""

    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float | None
    reused_tokens: int = 0
    drafted: int = 0  # speculation: draft tokens proposed and accepted
    accepted: int = 0
    digest: str = ""  # of the generated token ids: speculation must not change greedy output


@dataclass
class Measurement:
    served: list[Served]
    wall_s: float
    breakdown: dict = field(default_factory=dict)  # in-flight only: where the executor's time went
    # closed loop: (seconds, tokens generated) from the start until the first client found no request left to
    # send, i.e. while all C clients had a request in flight; after that the run drains at falling concurrency
    full_load: tuple[float, int] | None = None


def params_for(request: Request) -> SamplingParams:
    return SamplingParams(max_new_tokens=request.output_len, ignore_eos=True)  # greedy, exact lengths


# -- in-flight batching ------------------------------------------------------------------------
def inflight(llm, requests: list[Request], concurrency: int | None = None, speculation=None,
             **executor_options) -> Measurement:
    """Serve through a fresh runtime Executor (max_running=1 makes it single-stream); `speculation`
    (runtime.speculation.speculator.Speculation) applies to every request."""
    executor = llm.new_executor(**executor_options)
    clock = StepClock(llm.runner, executor)
    full_load: list[tuple[float, int]] = []

    def submit_together(rs: list[Request]):
        return executor.submit_sequences([llm.make_sequence(r.prompt, params_for(r), speculation) for r in rs])

    try:
        start = now()
        if concurrency is None:
            done = _open_loop(submit_together, requests, start)
        else:
            done = _closed_loop(lambda r: submit_together([r])[0], requests, concurrency,
                                lambda: full_load.append((now() - start, executor.totals["generated_tokens"])))
        wall = now() - start
        kv = {k: v for k, v in executor.stats().items() if k in KV_STATS}
    finally:
        executor.shutdown()
        clock.restore()
    served = [_served(c) for c in done]
    breakdown = clock.breakdown(wall)
    breakdown["decode_active_rows"] = sum(s.output_tokens - 1 for s in served)  # the first token comes from the prompt
    breakdown.update(kv)
    return Measurement(served, wall, breakdown, full_load[0] if full_load else None)


def _open_loop(submit_together: Callable, requests: list[Request], start: float) -> list[Completion]:
    """Each request at its arrival time; those due together (a burst: every arrival 0) are queued as one batch,
    so the executor sees all of them at once however this thread is scheduled."""
    pending, handles = sorted(requests, key=lambda r: r.arrival_s), []
    while len(handles) < len(pending):
        time.sleep(max(0.0, start + pending[len(handles)].arrival_s - now()))
        due, clock = len(handles), now()
        while due < len(pending) and start + pending[due].arrival_s <= clock:
            due += 1
        handles += submit_together(pending[len(handles):due])
    return [h.result() for h in handles]


def _closed_loop(submit: Callable, requests: list[Request], clients: int,
                 drained: Callable[[], None] = lambda: None) -> list[Completion]:
    """`drained` is called once, by the first client that finds no request left to send."""
    queue, done, lock = deque(requests), [], threading.Lock()
    first_out = False

    def client() -> None:
        nonlocal first_out
        while True:
            with lock:
                if not queue:
                    if not first_out:
                        first_out = True
                        drained()
                    return
                r = queue.popleft()
            completion = submit(r).result()
            with lock:
                done.append(completion)

    threads = [threading.Thread(target=client, name=f"client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


def _served(c: Completion) -> Served:
    if c.finish_reason != "length":
        raise RuntimeError(f"a benchmark request ended with {c.finish_reason!r}: {c.error}")
    m, spec = c.metrics, c.metrics.get("speculation") or {}
    return Served(m["prompt_tokens"], m["output_tokens"], m["ttft_s"], m["tpot_s"], m["latency_s"],
                  m["reused_prompt_tokens"], spec.get("drafted", 0), spec.get("accepted", 0),
                  hashlib.sha256(str(c.token_ids).encode()).hexdigest()[:16])


class StepClock:
    """Times the executor's steps (from a step's plan to the end of its postprocess: its StepRecords) and, inside
    them, the runner's decode and extend calls, by wrapping the methods on the runner only (removed again by
    `restore`)."""

    def __init__(self, runner, executor: Executor):
        self.runner, self.executor = runner, executor
        self.totals = {"steps": 0, "step_s": 0.0, "decode_calls": 0, "decode_rows": 0, "decode_s": 0.0,
                       "extend_calls": 0, "extend_tokens": 0, "extend_s": 0.0}
        runner.decode = self._timed(runner.decode, "decode", lambda a: len(a[1]))
        runner.extend = self._timed(runner.extend, "extend", lambda a: len(a[2]))
        executor.add_step_observer(self._step)

    def _timed(self, method: Callable, name: str, size: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            t = now()
            try:
                return method(*args, **kwargs)
            finally:
                self.totals[f"{name}_s"] += now() - t
                self.totals[f"{name}_calls"] += 1
                self.totals[f"{name}_{'rows' if name == 'decode' else 'tokens'}"] += size(args)
        return wrapper

    def _step(self, record) -> None:  # the executor's StepRecord: from the step's plan to its postprocess's end
        self.totals["step_s"] += record.total_s
        self.totals["steps"] += 1

    def restore(self) -> None:
        for name in ("decode", "extend"):
            vars(self.runner).pop(name, None)
        self.executor.remove_step_observer(self._step)

    def breakdown(self, wall_s: float) -> dict:
        t = dict(self.totals)
        t["other_s"] = t["step_s"] - t["decode_s"] - t["extend_s"]  # schedule, sampling, postprocess
        t["idle_s"] = max(0.0, wall_s - t["step_s"])
        return t


# -- static batching ---------------------------------------------------------------------------
BatchFn = Callable[[list[Request]], tuple[list[float], list[float]]]  # -> first-token, last-token times


def static(batch_fn: BatchFn, requests: list[Request], max_batch: int, concurrency: int | None = None) -> Measurement:
    """Run batches one after another. Open loop: a batch takes every request that has arrived
    (up to max_batch); later arrivals wait for the next batch. Closed loop: batches of C, a
    client's next request arriving when its previous one got its last token."""
    served: list[Served] = []
    start = now()
    if concurrency is None:
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        while pending:
            time.sleep(max(0.0, start + pending[0].arrival_s - now()))
            elapsed = now() - start
            batch = []
            while pending and len(batch) < max_batch and pending[0].arrival_s <= elapsed:
                batch.append(pending.popleft())
            served += _run_batch(batch_fn, batch, [start + r.arrival_s for r in batch])
    else:
        c = min(concurrency, max_batch)
        arrive = [start] * len(requests)
        for k in range(0, len(requests), c):
            batch = requests[k:k + c]
            out = _run_batch(batch_fn, batch, arrive[k:k + c])
            for j, s in enumerate(out):
                if k + j + c < len(requests):
                    arrive[k + j + c] = arrive[k + j] + s.latency_s
            served += out
    wall = now() - start
    # closed loop: every batch holds C requests (the last may hold fewer), so the whole run is at full load
    full_load = None if concurrency is None else (wall, sum(s.output_tokens for s in served))
    return Measurement(served, wall, full_load=full_load)


def _run_batch(batch_fn: BatchFn, batch: list[Request], arrivals: list[float]) -> list[Served]:
    first, last = batch_fn(batch)
    return [Served(len(r.prompt), r.output_len, f - a, (l - f) / (r.output_len - 1) if r.output_len > 1 else None,
                   l - a) for r, a, f, l in zip(batch, arrivals, first, last)]


class RunnerBatch:
    """Static batching over the engine's ModelRunner: one ragged prefill of the whole batch (rows
    right-padded to the longest prompt), then batched greedy decode of every row until the
    slowest request has all its tokens."""

    def __init__(self, runner):
        self.runner = runner

    def __call__(self, batch: list[Request]) -> tuple[list[float], list[float]]:
        tokens = self.runner.prefill(0, [r.prompt for r in batch]).argmax(-1)  # [rows]
        t = now()
        first, last = [t] * len(batch), [t] * len(batch)
        past = np.array([len(r.prompt) for r in batch], dtype=np.int64)
        for step in range(2, max(r.output_len for r in batch) + 1):
            tokens = self.runner.decode(0, tokens, past).argmax(-1)
            past += 1
            t = now()
            last = [t if r.output_len == step else x for r, x in zip(batch, last)]
        return first, last


class HFBatch:
    """Static batching with transformers' generate: left padding, greedy, every row generating the
    batch's largest output length (min_new_tokens = max_new_tokens). A streamer timestamps steps."""

    def __init__(self, checkpoint, threads: int | None):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, trust_remote_code=False).eval()
        pad = self.model.generation_config.pad_token_id
        self.pad = pad if pad is not None else (self.model.config.pad_token_id or 0)

    def __call__(self, batch: list[Request]) -> tuple[list[float], list[float]]:
        torch, n = self.torch, max(r.output_len for r in batch)
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)  # [rows, width], left padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        stamps = _Stamps()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                min_new_tokens=n, pad_token_id=self.pad, streamer=stamps)
        steps = stamps.times[1:]  # the first put is the prompt
        return [steps[0]] * len(batch), [steps[r.output_len - 1] for r in batch]


class _Stamps:
    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(now())

    def end(self) -> None:
        pass
