"""The in-flight batching executor: requests join and leave the running batch at every step.

An engine step is schedule -> run -> postprocess. ONNX Runtime's CPU GroupQueryAttention cannot mix
a multi-token prompt row with decode rows in one call, so a step is one decode call over the range
of slots in use plus one call per prompt chunk, all over views of the same KV buffers."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

import numpy as np

from runtime.speculation.draft_policy import timed
from runtime.request.sampler import candidates_suffice, sample, sample_candidates
from runtime.batching.block_table import BlockConfig
from runtime.batching.scheduler import Scheduler, StepPlan
from runtime.request.sequence import Sequence, Status
from runtime.speculation.speculator import Speculator


@dataclass
class Output:
    """One generated token and the text it completed (may be empty while a character is incomplete)."""

    token_id: int
    text: str


@dataclass
class Completion:
    """The result of one request."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    metrics: dict | None = None
    error: str | None = None


class RequestHandle:
    """Streams a request's tokens (plain or async iteration), can cancel it, and ends with a
    finish reason: stop, length, cancelled or error.

    `listener`: when given, every event goes to listener(output) on the executor thread instead of the
    handle's own queue, then listener(None) once the request has ended (runtime/async_engine.py feeds an
    asyncio queue this way); it must return at once and not raise."""

    def __init__(self, seq: Sequence, executor: Executor, listener: Callable[[Output | None], None] | None = None):
        self.seq, self._executor, self._listener = seq, executor, listener
        self._events: queue.Queue[Output | None] = queue.Queue()
        self._done = threading.Event()

    @property
    def id(self) -> int:
        return self.seq.id

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason if self._done.is_set() else None

    def cancel(self) -> None:
        self._executor.cancel(self)

    def __iter__(self) -> Iterator[Output]:
        while (event := self._events.get()) is not None:
            yield event

    async def __aiter__(self) -> AsyncIterator[Output]:
        loop = asyncio.get_running_loop()
        while (event := await loop.run_in_executor(None, self._events.get)) is not None:
            yield event

    def text_stream(self) -> Iterator[str]:
        return (o.text for o in self if o.text)

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        s = self.seq
        return Completion(s.text, list(s.output_ids), len(s.prompt_ids), s.finish_reason, s.metrics(), s.error)

    def _emit(self, output: Output) -> None:
        (self._listener or self._events.put)(output)

    def _close(self) -> None:
        self._done.set()
        (self._listener or self._events.put)(None)


class Executor:
    """Serves many concurrent requests on one loaded engine from a background thread.

    `runner` runs the engine (a ModelRunner, or a tensor-parallel rank 0) on its KV cache; `draft_runner`
    the optional draft engine, whose slots mirror the target's. `max_running` rows decode together
    (default: every KV slot); `max_tokens_per_step` bounds the tokens one step computes, so long prompts
    are prefilled in chunks while others keep decoding; `min_prefix_reuse`: the shortest cached prompt
    prefix worth reusing; `blocks`: the KV budget in blocks and prefix caching (runtime/batching/block_table.py;
    default: every row's max_seq_len in blocks of 16). runtime.engine.LLM builds one over its runners."""

    def __init__(self, runner, draft_runner=None, max_running: int | None = None, max_tokens_per_step: int = 128,
                 min_prefix_reuse: int = 8, blocks: BlockConfig | None = None):
        for name, value in (("max_running", max_running), ("max_tokens_per_step", max_tokens_per_step),
                            ("min_prefix_reuse", min_prefix_reuse)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or None for max_running: every KV slot), "
                                 f"got {value!r}")
        self.runner = runner
        self.speculator = Speculator(runner, draft_runner)
        mirrors = () if draft_runner is None else (draft_runner.cache,)
        self.scheduler = Scheduler(runner.cache, max_running or runner.cache.spec.slots, max_tokens_per_step,
                                   min_prefix_reuse, blocks, mirrors)
        self._handles: dict[int, RequestHandle] = {}
        self._cancelled: set[int] = set()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._recent: deque[tuple[float, int]] = deque()
        self.totals = {"steps": 0, "generated_tokens": 0, "prompt_tokens_computed": 0,
                       "prompt_tokens_reused": 0, "finished": 0, "kv_live_tokens": 0, "kv_allocated_tokens": 0}
        self._kv_now = (0, 0, 0)  # the last step's (blocks used, blocks held by running sequences, live tokens)

    # -- API ------------------------------------------------------------------------------------
    def submit_sequence(self, seq: Sequence, listener: Callable[[Output | None], None] | None = None) -> RequestHandle:
        handle = RequestHandle(seq, self, listener)
        with self._lock:
            if self._closed:
                raise RuntimeError("the executor is shut down")
            self._handles[seq.id] = handle
            self.scheduler.add(seq)
            self._ensure_thread()
            self._lock.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            self._cancelled.add(handle.id)
            self._lock.notify()

    def stats(self) -> dict:
        """Queue depth, running rows, recent tokens/s and totals."""
        with self._lock:
            now = time.perf_counter()
            while self._recent and now - self._recent[0][0] > 10.0:
                self._recent.popleft()
            span = now - self._recent[0][0] if self._recent else 0.0
            rate = sum(n for _, n in self._recent) / span if span > 0 else 0.0
            return {"queue_depth": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                    "free_slots": len(self.scheduler.slots.free), "tokens_per_s": rate, **self.totals,
                    **self.scheduler.counters, **self._kv_stats()}

    def _kv_stats(self) -> dict:
        """KV blocks in the budget and in use (running sequences' and cached ones), and waste: the share
        of the blocks running sequences hold that no live token fills, now and over every step so far."""
        used, held, live = self._kv_now
        size = self.scheduler.blocks.size
        allocated = self.totals["kv_allocated_tokens"]
        return {"kv_blocks_total": self.scheduler.blocks.num_blocks, "kv_blocks_used": used, "kv_block_size": size,
                "kv_waste_ratio": 1.0 - live / (held * size) if held else 0.0,
                "kv_waste_ratio_mean": 1.0 - self.totals["kv_live_tokens"] / allocated if allocated else 0.0}

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    # -- loop -----------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self.scheduler.has_work and not self._cancelled:
                    self._lock.wait()
                if self._closed:
                    self._fail_all("cancelled", "executor shut down")
                    return
            self.step()

    def step(self) -> None:
        """schedule -> run -> postprocess, once."""
        start = time.perf_counter()
        with self._lock:
            self._reap_cancelled()
            plan = self.scheduler.schedule()
            self._sample_kv()
        if plan.empty:
            return
        run_start = time.perf_counter()
        logits = self._run(plan)
        run_end = time.perf_counter()
        with self._lock:
            self._postprocess(plan, logits)
            self.totals["steps"] += 1
        self.speculator.costs.observe_step_overhead(run_start - start + time.perf_counter() - run_end)

    def _sample_kv(self) -> None:
        self._kv_now = used, held, live = self.scheduler.kv_usage()
        self.totals["kv_live_tokens"] += live
        self.totals["kv_allocated_tokens"] += held * self.scheduler.blocks.size

    def _run(self, plan: StepPlan) -> dict[int, np.ndarray | list[int] | Exception]:
        """Per sequence that advances this step: logits [vocab] to sample from, the tokens a
        speculative verify call accepted, or the exception of its call."""
        out: dict[int, np.ndarray | list[int] | Exception] = {}
        plain, speculative = self._propose(plan.decode, out)
        if plain:
            try:
                with timed(self.runner) as call:
                    logits = self._decode(plain)
                if call.warm:  # a call that binds a new shape is not typical
                    self.speculator.costs.observe_plain(len(plain), call.seconds)
                out.update({s.id: logits[i] for i, s in enumerate(plain)})
            except Exception as err:  # the call failed: only its rows fail
                out.update({s.id: err for s in plain})
        for seq, drafts, probs in speculative:
            try:
                out[seq.id] = tokens = self.speculator.verify(seq, drafts, probs)
                self.scheduler.advance([seq], len(tokens))  # the last token and the accepted drafts are cached
            except Exception as err:
                out[seq.id] = err
        for seq, n in plan.prefill:
            try:
                logits = self.runner.extend(seq.slot, seq.num_cached, seq.prefill_ids[seq.num_cached:seq.num_cached + n])
                self._advance_prompt(seq, n)
                if seq.status is Status.DECODE:
                    out[seq.id] = logits[-1]
            except Exception as err:
                out[seq.id] = err
        return out

    def _propose(self, seqs: list[Sequence], out: dict) -> tuple[list[Sequence], list[tuple]]:
        """Split decode rows: speculating rows with a draft get their own verify call; rows
        without speculation, without a draft this step, or whose drafting does not pay (measured
        costs, see Speculator.should_draft) join the batched decode call."""
        plain, speculative = [], []
        for seq in seqs:
            if seq.spec is None or not self.speculator.should_draft(seq, len(seqs)):
                plain.append(seq)
                continue
            try:
                drafts, probs = self.speculator.propose(seq)
            except Exception as err:
                out[seq.id] = err
                continue
            if drafts:
                speculative.append((seq, drafts, probs))
            else:
                plain.append(seq)
        return plain, speculative

    def _advance_prompt(self, seq: Sequence, n: int) -> None:
        self.scheduler.advance([seq], n)
        self.totals["prompt_tokens_computed"] += n
        if seq.status is Status.DECODE:  # its prompt is all cached now
            self.totals["prompt_tokens_reused"] += seq.reused

    def _decode(self, seqs: list[Sequence]) -> np.ndarray | list[list[int] | Exception]:
        """One call over slots [lo, hi]; slots in between that are not in this call (free, still
        prefilling, or speculating) ride along with a dummy token written just past their valid KV,
        which their next call overwrites and nothing reads."""
        lo, hi = min(s.slot for s in seqs), max(s.slot for s in seqs)
        bucket = self.runner.bucket(hi + 1)
        if bucket is not None:  # fixed-buffer (CUDA-graph) decode: rows [0, bucket), the rest ride along
            lo, hi = 0, bucket - 1
        tokens = np.zeros(hi - lo + 1, dtype=np.int64)
        past = self.scheduler.slots.positions(lo, hi)
        for s in seqs:
            tokens[s.slot - lo] = s.all_ids[s.num_cached]
        head = self._head(seqs)
        result = self.runner.decode(lo, tokens, past, head)
        self.scheduler.advance(seqs, 1)
        rows = [s.slot - lo for s in seqs]
        if head == "next_token":
            return [[int(result[r])] for r in rows]
        if head == "topk":
            return [self._draw_candidate(s, result[0][r], result[1][r]) for s, r in zip(seqs, rows)]
        return result[rows]

    def _head(self, seqs: list[Sequence]) -> str:
        """The engine outputs a decode call reads: the graph's ArgMax when every row is greedy without a
        penalty, its TopK candidates when every row samples with top_k in 1..K and no penalty, else the
        full logits (repetition penalty, top_k 0 or above K, or an engine without a sampling head)."""
        if self.runner.has_next_token and all(s.params.greedy and s.params.repetition_penalty == 1.0 for s in seqs):
            return "next_token"
        if self.runner.top_k and all(candidates_suffice(s.params, self.runner.top_k) for s in seqs):
            return "topk"
        return "logits"

    @staticmethod
    def _draw_candidate(seq: Sequence, values: np.ndarray, ids: np.ndarray) -> list[int] | Exception:
        try:
            return [sample_candidates(values, ids, seq.params, seq.rng)]
        except Exception as err:  # only this row fails: _postprocess ends it under the lock, like a failed call
            return err

    def _postprocess(self, plan: StepPlan, logits: dict[int, np.ndarray | Exception]) -> None:
        seqs = [s for s in plan.decode + [p for p, _ in plan.prefill] if s.id in logits]
        good = [s for s in seqs if not isinstance(logits[s.id], Exception)]
        for s in seqs:
            if isinstance(logits[s.id], Exception):
                self._finish(s, "error", f"{type(logits[s.id]).__name__}: {logits[s.id]}")
        if not good:
            return
        chosen = [s for s in good if isinstance(logits[s.id], list)]
        sampled = [s for s in good if not isinstance(logits[s.id], list)]
        tokens = dict(zip([s.id for s in sampled], self._sample(sampled, logits))) if sampled else {}
        tokens.update({s.id: logits[s.id] for s in chosen})
        produced = 0
        for s in good:
            for token in tokens[s.id] if isinstance(tokens[s.id], list) else [tokens[s.id]]:
                if token is None or s.finished:
                    break
                self._handles[s.id]._emit(Output(token, s.append(token)))
                produced += 1
            if s.finished:
                self._finish(s, s.finish_reason)
        self.totals["generated_tokens"] += produced
        self._recent.append((time.perf_counter(), produced))

    def _sample(self, seqs: list[Sequence], logits: dict) -> list[int | None]:
        rows = np.stack([logits[s.id] for s in seqs])
        try:
            return [int(t) for t in sample(rows, [s.params for s in seqs], [s.history() for s in seqs],
                                           [s.rng for s in seqs])]
        except Exception:  # isolate the failing row
            out: list[int | None] = []
            for i, s in enumerate(seqs):
                try:
                    out.append(int(sample(rows[i:i + 1], [s.params], [s.history()], [s.rng])[0]))
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
            handle._close()

    def _reap_cancelled(self) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            if seq.id in self._cancelled:
                self._finish(seq, "cancelled")
        self._cancelled.clear()

    def _fail_all(self, reason: str, error: str) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            self._finish(seq, reason, error)
