"""The in-flight batching executor: requests join and leave the running batch at every step.

An engine step is schedule -> run -> postprocess. ONNX Runtime's CPU GroupQueryAttention cannot mix
a multi-token prompt row with decode rows in one call, so a step is one decode call over the range
of slots in use plus one call per prompt chunk, all over views of the same KV buffers."""
from __future__ import annotations

import itertools
import queue
import threading
import time
import traceback
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from runtime.batching.handle import Completion, Output, RequestHandle  # noqa: F401  (the executor's API types)
from runtime.config import ExecutorConfig
from runtime.request.sampler import sample
from runtime.batching.block_table import BlockConfig
from runtime.batching.decode import Row, decode_call, decode_calls, head_for, run_calls
from runtime.batching.render import Renderer
from runtime.batching.scheduler import Scheduler, StepPlan
from runtime.request.sequence import Sequence, Status
from runtime.speculation.speculator import Speculator

RATE_WINDOW_S = 10.0  # stats()["tokens_per_s"] is the rate over the steps of the last this many seconds


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
        self.packed = getattr(runner, "packed", False)  # packed steps over any rows (a paged engine's runner)
        self.speculator = Speculator(runner, draft_runner)
        mirrors = () if draft_runner is None else (draft_runner.cache,)
        self.scheduler = Scheduler(runner.cache, config.max_running or runner.cache.spec.slots,
                                   config.max_tokens_per_step, config.min_prefix_reuse, blocks, mirrors)
        self._handles: dict[int, RequestHandle] = {}
        self._cancelled: set[int] = set()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._recent: deque[tuple[float, int]] = deque()
        self._rode: list[int] = []  # rows the last step's decode calls covered with a dummy token (SlotTable.cool)
        self._marks = [0.0, 0.0, 0.0]  # this step's start, and its engine calls' start and end (StepCosts)
        self.renderer = Renderer()  # text owed to callers (runtime/batching/render.py)
        overlap = config.overlaps(runner.cache.device)
        # overlap: the engine calls run here while the executor's thread renders the last step's text
        self._engine = ThreadPoolExecutor(1, thread_name_prefix="engine-call") if overlap else None
        # lookahead: decode steps scheduled at once and run back to back on the engine thread (_chain)
        self.lookahead = config.steps_ahead(runner.cache.device)
        self._stop_chain = False  # set by this thread when a chain's later steps are no longer wanted
        self.failure: str | None = None  # the error that stopped the step loop (_loop), if one did
        self._step_listeners: list[weakref.WeakMethod] = []  # add_step_listener
        self.totals = {"steps": 0, "generated_tokens": 0, "prompt_tokens_computed": 0,
                       "prompt_tokens_reused": 0, "finished": 0, "steps_run_ahead": 0}

    # -- API ------------------------------------------------------------------------------------
    def submit_sequence(self, seq: Sequence, listener: Callable[[Output | None], None] | None = None) -> RequestHandle:
        handle = RequestHandle(seq, self, listener)
        with self._lock:
            if self._closed:
                raise RuntimeError("the executor is shut down" + (f" ({self.failure})" if self.failure else ""))
            self._handles[seq.id] = handle
            self.scheduler.add(seq)
            self._ensure_thread()
            self._lock.notify()
        return handle

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """listener() on the executor thread whenever a step has handed its events to the handles' listeners
        (and after shutdown's): runtime/async_engine.py wakes its event loop once per step this way. Held
        weakly: a bound method, listening as long as its object lives."""
        self._step_listeners.append(weakref.WeakMethod(listener))

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
        if self._engine is not None:
            self._engine.shutdown()

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
            self._stop_chain = True  # an engine thread still running a chain stops after its step
            with self._lock:
                self._closed, self.failure = True, f"{type(err).__name__}: {err}"
                self._fail_all("error", f"the executor stopped: {self.failure}")
            self._handed_over()

    def _steps(self) -> None:
        """Steps until shut down, one lock acquisition per step: the last step's postprocess, then the next plan."""
        rows: list[Row] = []
        while True:
            with self._lock:
                if rows:
                    self._postprocess(rows)
                if not self.scheduler.has_work:
                    self._settle()  # nothing runs: the text still owed goes out now
                    self._handed_over()  # before sleeping: the listeners learn of the last events now
                while not self._closed and not self.scheduler.has_work and not self._cancelled:
                    self._lock.wait()
                if self._closed:
                    self._fail_all("cancelled", "executor shut down")
                    break
                plan = self._plan()
            rows = self._call(plan)  # tells the listeners once it has handed over the text owed
        self._handed_over()

    def step(self) -> None:
        """schedule -> run -> postprocess, once (its text handed over before it returns); a plan run ahead
        (lookahead) is several decode steps."""
        with self._lock:
            plan = self._plan()
        rows = self._call(plan)
        with self._lock:
            if rows:
                self._postprocess(rows)
            if self._engine is not None or not rows:
                self._settle()
        self._handed_over()

    def _call(self, plan: StepPlan) -> list[Row]:
        """Run the plan; with overlap, on the engine thread while this one renders the last step's text."""
        if self._engine is None or plan.empty:
            self.renderer.run()
            self._handed_over()
            return self._run(plan) if not plan.empty else []
        if plan.steps > 1:
            return self._chain(plan)
        call = self._engine.submit(self._run, plan)
        self.renderer.run()
        self._handed_over()
        return call.result()

    def _chain(self, plan: StepPlan) -> list[Row]:
        """A plan's decode steps back to back on the engine thread (_run_chain), each step's tokens recorded and
        handed out here while the next one runs; a step that finishes a row, a cancellation, or a request that
        could take a free row ends the chain after the step already running. Returns the last step's rows
        (postprocessed with the next plan, as a single step's are)."""
        steps: queue.SimpleQueue = queue.SimpleQueue()
        self._stop_chain = False
        self._engine.submit(self._run_chain, plan, steps)
        self.renderer.run()
        self._handed_over()
        for ran in itertools.count():  # until the engine thread says no step follows
            rows, rode, more = steps.get()
            if isinstance(rows, BaseException):
                raise rows
            self.totals["steps_run_ahead"] += ran > 0  # the first step is the plan's own
            if not more:
                self._rode = rode
                return rows
            with self._lock:
                self._rode = rode
                self._postprocess(rows, timed=False)
                self._stop_chain = (self._closed or bool(self._cancelled) or self.scheduler.could_admit
                                    or any(s.finished for s in plan.decode))
            self.renderer.run()
            self._handed_over()

    def _handed_over(self) -> None:
        """Tell the step listeners that events went to the handles."""
        for ref in list(self._step_listeners):
            listener = ref()
            if listener is None:  # its object is gone (an event loop's mailbox)
                self._step_listeners.remove(ref)
            else:
                listener()

    def _settle(self) -> None:
        """Hand over what is owed, retire what a stop string ended, close their handles (under the lock)."""
        self.renderer.run()
        if self._retire_stopped():
            self.renderer.run()  # their handles' closes

    def _retire_stopped(self) -> bool:
        stopped = self.renderer.take_stopped()
        for seq in stopped:
            self.renderer.drop_after_stop(seq)
            if seq.id in self._handles:  # not ended already (its last token both reached a length and a stop)
                self._finish(seq, "stop")
        return bool(stopped)

    def _plan(self) -> StepPlan:
        """Reap cancelled requests and schedule the next step (under the lock)."""
        self._marks[0] = time.perf_counter()
        if self._cancelled:  # most steps have none: no scan of every sequence
            self._reap_cancelled()
        plan = self.scheduler.schedule()
        if self.lookahead > 1 and self._chains(plan):
            self.scheduler.run_ahead(plan, self.lookahead)
        return plan

    def _chains(self, plan: StepPlan) -> bool:
        """Whether the plan's decode rows can run several steps back to back: each row's next token comes from
        the sampling head on the engine thread (ArgMax, or a draw from the TopK candidates) and none speculates
        (whether the plan is decode-only, with no request waiting for a row, is Scheduler.run_ahead's to say)."""
        return all(s.spec is None for s in plan.decode) and head_for(self.runner, plan.decode) != "logits"

    # -- run: the engine calls; no sequence state changes ----------------------------------------
    def _run(self, plan: StepPlan) -> list[Row]:
        """One Row per sequence the step ran, in the plan's order: its decode row (batched, or a speculative
        verify call of its own) or its prompt chunk."""
        self._marks[1] = time.perf_counter()
        rows = self._calls(plan)
        self._marks[2] = time.perf_counter()
        return rows

    def _run_chain(self, plan: StepPlan, steps: queue.SimpleQueue) -> None:
        """The engine thread's side of _chain: the first step's calls are planned from the sequences' state (a
        paged engine's block ids copied then: the scheduler reserved the chain's blocks), the later ones from the
        last step's outputs alone (each row's chosen token at its next position), so this thread reads no state
        the executor's thread changes meanwhile. Each step's (rows, riders, more) goes to `steps`; a failed call
        ends the chain with its rows' errors."""
        try:
            seqs, head = plan.decode, head_for(self.runner, plan.decode)
            calls = decode_calls(self.runner, self.scheduler.slots, seqs, frozen=True)
            rode = [row for call in calls for row in call.rode]
            self._marks[1] = time.perf_counter()
            for step in range(1, plan.steps + 1):
                rows = self._chain_step(calls, seqs, head)
                more = step < plan.steps and not self._stop_chain and all(row.error is None for row in rows)
                if not more:
                    self._marks[2] = time.perf_counter()
                steps.put((rows, rode, more))  # at once: the executor's thread wakes while the next call is prepared
                if not more:
                    return
                chosen = {row.seq.id: row.tokens[0] for row in rows}  # no row failed: each has its token
                for call in calls:
                    call.advance(chosen)
        except BaseException as err:  # a bug, not a failed call: the executor's thread raises it
            steps.put((err, [], False))

    def _chain_step(self, calls, seqs: list[Sequence], head: str) -> list[Row]:
        try:
            return run_calls(self.runner, calls, seqs, head)
        except Exception as err:
            return [Row(s, error=err) for s in seqs]

    def _calls(self, plan: StepPlan) -> list[Row]:
        plain, speculative, rows = self._propose(plan.decode)
        if self.packed and plan.prefill:  # a paged engine: decode rows and prompt chunks in one call
            decoded, prompts = self._packed(plain, plan.prefill)
        else:
            decoded, prompts = self._decode(plain) if plain else [], None
        if rows or speculative:  # rows that left the batched call: all back in the plan's order
            order = {s.id: i for i, s in enumerate(plan.decode)}
            rows += [self._verify(seq, drafts, probs) for seq, drafts, probs in speculative]
            decoded = sorted(rows + decoded, key=lambda row: order[row.seq.id])
        return decoded + (prompts if prompts is not None else [self._prefill(seq, n) for seq, n in plan.prefill])

    def _packed(self, plain: list[Sequence], prefill: list[tuple[Sequence, int]]) -> tuple[list[Row], list[Row]]:
        """Decode rows and prompt chunks in one packed call (runtime/model/paged_runner.py), read as logits;
        Rows for the decode rows and for the chunks. A failed call fails all of them."""
        seqs = plain + [seq for seq, _ in prefill]
        new = [[s.token(s.num_cached)] for s in plain] + [s.prefill_ids[s.num_cached:s.num_cached + n] for s, n in prefill]
        try:
            logits = self.runner.step([s.slot for s in seqs], [s.num_cached for s in seqs], new)
        except Exception as err:
            return [Row(s, error=err) for s in plain], [Row(s, error=err, prompt=True) for s, _ in prefill]
        chunks = [Row(s, n, logits=logits[len(plain) + i] if n == s.num_uncached_prompt else None, prompt=True)
                  for i, (s, n) in enumerate(prefill)]
        return [Row(s, 1, logits=logits[i]) for i, s in enumerate(plain)], chunks

    def _propose(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[tuple], list[Row]]:
        """Split decode rows: speculating rows with a draft get their own verify call; rows
        without speculation, without a draft this step, or whose drafting does not pay (measured
        costs, see Speculator.should_draft) join the batched decode call. A failed proposal is its row's error."""
        plain, speculative, failed = [], [], []
        for seq in seqs:
            if seq.spec is None or not self.speculator.should_draft(seq, len(seqs)):
                plain.append(seq)
                continue
            try:
                drafts, probs = self.speculator.propose(seq)
            except Exception as err:
                failed.append(Row(seq, error=err))
                continue
            if drafts:
                speculative.append((seq, drafts, probs))
            else:
                plain.append(seq)
        return plain, speculative, failed

    def _decode(self, seqs: list[Sequence]) -> list[Row]:
        """One call over slots [lo, hi]; slots in between that are not in this call (free, still
        prefilling, or speculating) ride along with a dummy token written just past their valid KV,
        which their next call overwrites and nothing reads. A failed call fails only its rows."""
        shapes, start = self.runner.new_call_shapes, time.perf_counter()
        try:
            rows = decode_call(self.runner, self.scheduler.slots, seqs, self._rode)
        except Exception as err:
            return [Row(s, error=err) for s in seqs]
        if self.runner.new_call_shapes == shapes:  # a call that binds a new shape is not typical
            self.speculator.costs.observe_plain(len(seqs), time.perf_counter() - start)
        return rows

    def _verify(self, seq: Sequence, drafts: list[int], probs) -> Row:
        """A speculating row's verify call: the tokens it accepted (the last token and the accepted drafts
        are cached)."""
        try:
            tokens = self.speculator.verify(seq, drafts, probs)
        except Exception as err:
            return Row(seq, error=err)
        return Row(seq, len(tokens), tokens=tokens)

    def _prefill(self, seq: Sequence, n: int) -> Row:
        """A prompt chunk of `n` tokens. The chunk that completes the prompt gives the first token: a greedy row's
        from the graph's ArgMax (it never reads the full logits), else the logits to sample from; an earlier chunk
        reads the cheapest output the engine has, and nothing of it."""
        last, scored = n == seq.num_uncached_prompt, seq.params.prompt_logprobs is not None
        greedy = head_for(self.runner, [seq]) == "next_token" if last else self.runner.has_next_token and not scored
        try:
            out = self.runner.extend(seq.slot, seq.num_cached, seq.prefill_ids[seq.num_cached:seq.num_cached + n],
                                     all_logits=scored, head="next_token" if greedy else "logits")
        except Exception as err:
            return Row(seq, error=err, prompt=True)
        row = Row(seq, n, prompt=True, prompt_logits=out if scored else None)
        if last:
            row.tokens, row.logits = ([int(out[-1])], None) if greedy else (None, out[-1])
        return row

    # -- postprocess: progress, then tokens, under the lock -------------------------------------
    def _postprocess(self, rows: list[Row], timed: bool = True) -> None:
        """Progress, then tokens: each accepted and its text owed (rendered now, or during the next call).
        `timed`: the step's host overhead is measured (not a chain's inner step, which ran behind the next)."""
        self._retire_stopped()  # with overlap: stop strings found while this step ran; their rows are dropped
        rows = [row for row in rows if not row.seq.finished]
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
                row.logits = row.seq.guide.mask(row.logits)
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
        produced = -self.renderer.take_dropped()  # tokens accepted past a stop string found late
        for row in good:
            s, first = row.seq, len(row.seq.output_ids)
            for token in row.tokens:
                if token is None or s.finished:
                    break
                if self._engine is None:  # rendered now: a stop string ends the row at its token
                    self._handles[s.id]._emit(Output(token, s.append(token)))
                else:
                    s.accept(token)
            if self._engine is not None and len(s.output_ids) > first:
                self.renderer.owe(s, self._handles[s.id], first, len(s.output_ids) - first)
            produced += len(s.output_ids) - first
            if s.finished:
                self._finish(s, s.finish_reason)
        if self._engine is None:
            self._settle()
        self.scheduler.slots.cool(self._rode)
        self._rode = []
        self.totals["steps"] += 1
        self.totals["generated_tokens"] += produced
        start, run_start, run_end = self._marks
        now = self._trim_recent()  # each step: stats() may never be called (a server nobody scrapes)
        self._recent.append((now, produced))
        if timed:
            self.speculator.costs.observe_step_overhead(run_start - start + now - run_end)

    def _advance(self, rows: list[Row]) -> None:
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

    def _sample(self, rows: list[Row]) -> list[int | None]:
        if not rows:
            return []
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
        if seq.finish_reason != reason:
            seq.finish(reason, error)
        self.scheduler.retire(seq)
        self.totals["finished"] += 1
        handle = self._handles.pop(seq.id, None)
        if handle is not None:
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
