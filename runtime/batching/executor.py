"""The in-flight batching executor: requests join and leave the running batch at every step.

An engine step is schedule -> run -> postprocess: the scheduler plans it (runtime/batching/scheduler.py), the run
stage makes its engine calls (runtime/batching/run_stage.py, on an engine thread of its own with overlap), and
postprocess here records what each row produced, under the lock. The executor owns the threads, submission,
cancellation and the requests' handles; each step ends with a StepRecord for the step observers."""
from __future__ import annotations

import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from runtime.batching.handle import Completion, Output, RequestHandle  # noqa: F401  (the executor's API types)
from runtime.config import ExecutorConfig
from runtime.request.sampler import sample
from runtime.request.validate import RequestError
from runtime.batching.block_table import BlockConfig
from runtime.batching.decode import StepResult
from runtime.batching.render import Renderer
from runtime.batching.run_stage import StepRun, RunStage
from runtime.batching.scheduler import Scheduler, StepPlan
from runtime.request.sequence import Sequence, Status
from runtime.speculation.eagle import keep_features
from runtime.speculation.speculator import Speculator

RATE_WINDOW_S = 10.0  # stats()["tokens_per_s"] is the rate over the steps of the last this many seconds


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as the executor ran it, for step observers (Executor.add_step_observer: benchmarks):
    perf_counter seconds when it was scheduled and when its postprocess ended, its phases' seconds, and what it
    ran. A step run ahead (`ahead`: a later step of a plan of several) shares its plan's start and schedule, its
    run from the plan's start to its own end; it is recorded while the next one runs."""

    started: float
    schedule_s: float
    run_s: float
    postprocess_s: float
    sample_s: float  # sampling on the host, inside postprocess
    decode_rows: int
    prompt_tokens: int  # prompt tokens computed
    tokens: int  # tokens generated
    ahead: bool
    ended: float

    @property
    def total_s(self) -> float:
        return self.ended - self.started


class Executor:
    """Serves many concurrent requests on one loaded engine from a background thread.

    `runner` runs the engine (a ModelRunner, or a tensor-parallel rank 0) on its KV cache; `draft_runner`
    the optional draft engine, whose slots mirror the target's. `config` (runtime/config.py): rows decoded
    together, tokens per step, shortest prefix reused. `blocks`: the KV budget in blocks and prefix caching
    (runtime/batching/block_table.py; default: every row's max_seq_len in blocks of 16). runtime.engine.LLM
    builds one over its runners."""

    def __init__(self, runner, draft_runner=None, config: ExecutorConfig = ExecutorConfig(),
                 blocks: BlockConfig | None = None):
        self.runner = runner
        self.speculator = Speculator(runner, draft_runner)
        mirrors = () if draft_runner is None else (draft_runner.cache,)
        self.scheduler = Scheduler(runner.cache, config.max_running or runner.cache.spec.slots,
                                   config.max_tokens_per_step, config.min_prefix_reuse, blocks, mirrors,
                                   config.compaction, adapters=runner.lora)
        self.kv = self.scheduler.slots  # the KV table: lays out each step's calls (runtime/batching/kv_table.py)
        self._handles: dict[int, RequestHandle] = {}
        self._cancelled: set[int] = set()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._recent: deque[tuple[float, int]] = deque()
        self._ran = StepRun()  # the last step's run, recorded in postprocess
        self._sample_s = 0.0  # the last step's sampling on the host
        self._planned = (0.0, 0.0)  # when the last plan's schedule started and ended
        self.renderer = Renderer()  # text owed to callers (runtime/batching/render.py)
        self._stopped: list[Sequence] = []  # sequences whose text completed a stop string, to end (_end_stopped)
        # overlap: the engine calls run on a thread of their own (runtime/batching/run_stage.py)
        self.run_stage = RunStage(runner, self.kv, self.speculator, config.overlaps(runner.cache.device))
        self._engine = self.run_stage.engine  # None: no overlap
        # lookahead: decode steps scheduled at once and run back to back on the engine thread
        self.lookahead = config.steps_ahead(runner.cache.device)
        self.failure: str | None = None  # the error that stopped the step loop (_loop), if one did
        self._step_listeners: list[weakref.WeakMethod] = []  # add_step_listener
        self._observers: list[Callable[[StepRecord], None]] = []  # add_step_observer
        self.totals = {"steps": 0, "generated_tokens": 0, "prompt_tokens_computed": 0,
                       "prompt_tokens_reused": 0, "finished": 0, "steps_run_ahead": 0}

    # -- API ------------------------------------------------------------------------------------
    def submit_sequence(self, seq: Sequence, listener: Callable[[Output | None], None] | None = None) -> RequestHandle:
        handle = RequestHandle(seq, self, listener)
        with self._lock:
            if self._closed:
                raise RuntimeError("the executor is shut down" + (f" ({self.failure})" if self.failure else ""))
            if self.runner.lora is not None:  # queued on its adapter: an unload waits for it (a refused one: no)
                try:
                    self.runner.lora.track(seq)
                except ValueError as err:  # unloaded since the request was validated: the caller's error, as then
                    raise RequestError(str(err), field="adapter") from None
            self._handles[seq.id] = handle
            self.scheduler.add(seq)
            self._ensure_thread()
            self._lock.notify()
        return handle

    def submit_sequences(self, seqs: list[Sequence]) -> list[RequestHandle]:
        """Queue several sequences at once: the step loop sees all of them or none, so a batch of prompts starts
        together (the same rows, the same first step) however the submitting thread is scheduled. One refused
        (its adapter unloaded since validation) cancels those queued before it and raises."""
        handles: list[RequestHandle] = []
        with self._lock:  # re-entrant: submit_sequence takes it again
            try:
                for seq in seqs:
                    handles.append(self.submit_sequence(seq))
            except Exception:
                self._cancelled.update(h.id for h in handles)
                raise
        return handles

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """listener() on the executor thread whenever a step has handed its events to the handles' listeners
        (and after shutdown's): runtime/async_engine.py wakes its event loop once per step this way. Held
        weakly: a bound method, listening as long as its object lives."""
        self._step_listeners.append(weakref.WeakMethod(listener))

    def add_step_observer(self, observer: Callable[[StepRecord], None]) -> None:
        """observer(record) on the executor thread after each step's postprocess, with its StepRecord (phase
        timings, rows, tokens): how benchmarks time steps. Held until `remove_step_observer`."""
        self._observers.append(observer)

    def remove_step_observer(self, observer: Callable[[StepRecord], None]) -> None:
        self._observers.remove(observer)

    def cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            self._cancelled.add(handle.id)
            self._lock.notify()

    def stats(self) -> dict:
        """Queue depth, running rows, recent tokens/s and totals."""
        with self._lock:
            now = self._trim_recent()
            span = now - self._recent[0][0] if self._recent else 0.0
            rate = sum(n for _, n in self._recent) / span if span > 0 else 0.0
            return {"queue_depth": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                    "free_slots": len(self.scheduler.slots.free), "tokens_per_s": rate, **self.totals,
                    **self.scheduler.kv_stats()}

    def _trim_recent(self) -> float:
        """Drop the steps older than the rate window (call under the lock); returns now."""
        now = time.perf_counter()
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()
        return now

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        self.run_stage.shutdown()

    # -- loop -----------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        """Steps until shut down; a bug that escapes a step (not a failed engine call: that fails only its rows)
        ends every request with its error and shuts the executor, so no caller waits forever."""
        try:
            self._steps()
        except Exception as err:
            traceback.print_exc()
            self.run_stage.stop = True  # an engine thread still running a plan's steps stops after its step
            with self._lock:
                self._closed, self.failure = True, f"{type(err).__name__}: {err}"
                self._fail_all("error", f"the executor stopped: {self.failure}")
            self._handed_over()

    def _steps(self) -> None:
        """Steps until shut down, one lock acquisition per step: the last step's postprocess, then the next plan."""
        ran = StepRun()
        while True:
            with self._lock:
                if ran.rows:
                    self._record(ran)
                if not self.scheduler.has_work:
                    self._settle()  # nothing runs: the text still owed goes out now
                    self._handed_over()  # before sleeping: the listeners learn of the last events now
                while not self._closed and not self.scheduler.has_work and not self._cancelled:
                    self._lock.wait()
                if self._closed:
                    self._fail_all("cancelled", "executor shut down")
                    break
                plan = self._plan()
            ran = self._run(plan)  # tells the listeners once it has handed over the text owed
        self._handed_over()

    def step(self) -> None:
        """schedule -> run -> postprocess, once (its text handed over before it returns); a plan run ahead
        (lookahead) is several decode steps."""
        with self._lock:
            plan = self._plan()
        ran = self._run(plan)
        with self._lock:
            if ran.rows:
                self._record(ran)
            if self._engine is not None or not ran.rows:
                self._settle()
        self._handed_over()

    def _run(self, plan: StepPlan) -> StepRun:
        """Run the plan (runtime/batching/run_stage.py); with overlap, on the engine thread while this one renders
        the last step's text. A plan of several steps: each step but the last is recorded here while the next one
        runs, and a step that finishes a row, a cancellation, or a request that could take a free row ends the
        plan after the step already running. Returns the last step's run (recorded with the next plan)."""
        return self.run_stage.run(plan, self._render, lambda ran: self._ahead(plan, ran))

    def _render(self) -> None:
        """While the engine calls run (outside the lock): the text owed goes out; a stop string it completes ends
        its sequence at the next postprocess, when no call holds its row."""
        self._stopped += self.renderer.run()
        self._handed_over()

    def _ahead(self, plan: StepPlan, ran: StepRun) -> bool:
        """Record a step of a plan run ahead while the next one runs; whether the plan's later steps are unwanted."""
        self.totals["steps_run_ahead"] += 1
        with self._lock:
            self._record(ran, ahead=True)
            return (self._closed or bool(self._cancelled) or self.scheduler.could_admit
                    or any(s.finished for s in plan.decode))

    def _handed_over(self) -> None:
        """Tell the step listeners that events went to the handles."""
        for ref in list(self._step_listeners):
            listener = ref()
            if listener is None:  # its object is gone (an event loop's mailbox)
                self._step_listeners.remove(ref)
            else:
                listener()

    def _settle(self) -> None:
        """Hand over what is owed, end what a stop string stopped, close their handles (under the lock)."""
        self._stopped += self.renderer.run()
        if self._end_stopped():
            self.renderer.run()  # their handles' closes

    def _end_stopped(self) -> bool:
        """End the sequences whose text completed a stop string since the last call; whether there were any."""
        stopped, self._stopped = self._stopped, []
        for seq in stopped:
            self._finish(seq, "stop")
        return bool(stopped)

    def _plan(self) -> StepPlan:
        """Reap cancelled requests and schedule the next step (under the lock)."""
        start = time.perf_counter()
        if self._cancelled:  # most steps have none: no scan of every sequence
            self._reap_cancelled()
        plan = self.scheduler.schedule()
        if self.lookahead > 1 and self.run_stage.can_run_ahead(plan):
            self.scheduler.run_ahead(plan, self.lookahead)
        self._planned = (start, time.perf_counter())
        return plan

    # -- postprocess: progress, then tokens, under the lock -------------------------------------
    def _record(self, ran: StepRun, ahead: bool = False) -> None:
        """Postprocess a step's run, and hand its StepRecord to the step observers (when there are any)."""
        self._ran = ran
        if not self._observers:
            self._postprocess(ran.rows, timed=not ahead)
            return
        start, tokens, prompts = time.perf_counter(), self.totals["generated_tokens"], self.totals["prompt_tokens_computed"]
        self._sample_s = 0.0
        self._postprocess(ran.rows, timed=not ahead)
        planned, end = self._planned, time.perf_counter()
        record = StepRecord(planned[0], planned[1] - planned[0], ran.ended - ran.started, end - start, self._sample_s,
                            sum(not row.prompt for row in ran.rows), self.totals["prompt_tokens_computed"] - prompts,
                            self.totals["generated_tokens"] - tokens, ahead, end)
        for observer in list(self._observers):
            observer(record)

    def _postprocess(self, rows: list[StepResult], timed: bool = True) -> None:
        """Progress, then tokens: each accepted and its text owed (rendered now, or during the next call); a token
        that ends its sequence (EOS, max_new_tokens) ends it here, through `_finish`, as a stop string does once
        rendered. `timed`: the step's host overhead is measured (not a chain's inner step, which ran behind the next)."""
        self._end_stopped()  # with overlap: stop strings found while this step ran; their rows are dropped
        rows = [row for row in rows if not row.seq.finished]
        for row in rows:  # an EAGLE row's features, where its call computed them (before its progress moves there)
            if row.features is not None:
                keep_features(row.seq.speculation, row.seq.num_cached, row.features)
        self._advance(rows)
        good, to_sample = [], []
        for row in rows:
            if row.prompt_logits is not None:  # prompt logprobs asked for: the chunk's positions scored
                row.seq.scores.add_prompt(row.prompt_logits, row.seq.num_cached - row.cached, row.seq.prompt_ids)
            if row.error is not None:
                self._finish(row.seq, "error", f"{type(row.error).__name__}: {row.error}")
            elif row.tokens is not None:
                good.append(row)
            elif row.logits is not None:
                good.append(row)
                to_sample.append(row)
        for row in [row for row in to_sample if row.seq.guide is not None]:  # structured outputs: the grammar's mask
            try:
                row.logits = row.seq.guide.mask(row.logits, argmax_only=_takes_argmax(row.seq.params))
            except RuntimeError as err:
                self._finish(row.seq, "error", str(err))
                good.remove(row)
                to_sample.remove(row)
        for row, token in zip(to_sample, self._sample(to_sample)):
            row.tokens = [token]
            if row.seq.scores is not None and token is not None:  # log-probabilities asked for
                row.seq.scores.add(row.logits, row.seq, token)
            if row.seq.guide is not None and token is not None:
                row.seq.guide.consume(token)
        produced = 0
        for row in good:
            s, first, reason = row.seq, len(row.seq.output_ids), None
            for token in row.tokens:
                if token is None or (reason := s.accept(token)) is not None:
                    break
            if len(s.output_ids) > first:
                self.renderer.owe(s, self._handles[s.id], first, len(s.output_ids) - first)
            produced += len(s.output_ids) - first
            if reason is not None:
                self._finish(s, reason)
        if self._engine is None:  # rendered now: a stop string ends its row at once
            self._settle()
        produced -= self.renderer.take_dropped()  # tokens accepted past a stop string
        self.kv.cool(self._ran.rode)
        self.totals["steps"] += 1
        self.totals["generated_tokens"] += produced
        now = self._trim_recent()  # each step: stats() may never be called (a server nobody scrapes)
        self._recent.append((now, produced))
        if timed:
            self.speculator.costs.observe_step_overhead(self._ran.started - self._planned[0] + now - self._ran.ended)

    def _advance(self, rows: list[StepResult]) -> None:
        """The one place a step's KV progress is recorded: the tokens each row's call computed are cached."""
        decoded = [row.seq for row in rows if row.cached == 1 and not row.prompt]  # a batched decode's rows
        if decoded:
            self.scheduler.advance(decoded, 1)
        for row in rows:
            if row.cached and (row.prompt or row.cached > 1):
                self.scheduler.advance([row.seq], row.cached)
            if row.prompt and row.cached:
                self.totals["prompt_tokens_computed"] += row.cached
                if row.seq.status is Status.DECODE:  # its prompt is all cached now
                    self.totals["prompt_tokens_reused"] += row.seq.reused

    def _sample(self, rows: list[StepResult]) -> list[int | None]:
        if not rows:
            return []
        start = time.perf_counter()
        try:
            return self._draw(rows)
        finally:
            self._sample_s = time.perf_counter() - start

    def _draw(self, rows: list[StepResult]) -> list[int | None]:
        seqs = [row.seq for row in rows]
        logits = np.stack([row.logits for row in rows])
        try:
            return [int(t) for t in sample(logits, [s.params for s in seqs], [s.history() for s in seqs],
                                           [s.rng for s in seqs])]
        except Exception:  # isolate the failing row
            out: list[int | None] = []
            for i, s in enumerate(seqs):
                try:
                    out.append(int(sample(logits[i:i + 1], [s.params], [s.history()], [s.rng])[0]))
                except Exception as err:
                    self._finish(s, "error", f"sampling failed: {err}")
                    out.append(None)
            return out

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """The one place a sequence ends, once (stop | length | cancelled | error): why (Sequence.finish), its tokens
        past a stop string dropped, its row retired, its handle closed after the text it is owed. A sequence
        ended already (its last token reached a length, then its text a stop string) is left as it is: its
        finish reason says "stop" from its text."""
        handle = self._handles.pop(seq.id, None)
        if handle is None:
            return
        seq.finish(reason, error)
        self.renderer.drop_after_stop(seq)
        self.scheduler.retire(seq)
        self.totals["finished"] += 1
        self.renderer.close(seq, handle)  # after the text it is owed

    def _reap_cancelled(self) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            if seq.id in self._cancelled:
                self._finish(seq, "cancelled")
        self._cancelled.clear()

    def _fail_all(self, reason: str, error: str) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            self._finish(seq, reason, error)
        self._settle()


def _takes_argmax(params) -> bool:
    """Whether a row's token is its logits' argmax and nothing else reads them (a grammar then checks that one
    token before it builds a mask: runtime/request/structured.py, Guide.mask)."""
    return params.greedy and params.repetition_penalty == 1.0 and params.logprobs is None
