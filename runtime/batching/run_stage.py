"""The run stage of an engine step: the plan's engine calls, laid out by the KV table (runtime/batching/kv_table.py),
speculating rows proposed and verified on their own (runtime/speculation/speculator.py), run on the executor's
thread or, with `overlap`, on an engine thread of its own while the executor's thread renders the last step's
text; and a plan of several decode steps (`lookahead`: StepPlan.steps > 1) run back to back there, each step's
calls made from the last one's chosen tokens alone (`advance`). Nothing here changes sequence state: each step's
`StepRun` goes back to the executor, which records it (postprocess)."""
from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from runtime.batching.decode import StepResult, head_for, in_order, run_call
from runtime.batching.scheduler import StepPlan
from runtime.request.sequence import Sequence
from runtime.speculation.speculator import Speculator


@dataclass(slots=True)
class StepRun:
    """One step's run: a StepResult per sequence it ran (in the plan's order: decode rows, then prompt chunks), the
    idle rows its decode calls covered with a dummy token (SlotTable.cool), when its engine calls started and
    ended, and whether another step of the same plan follows (`more`)."""

    rows: list[StepResult] = field(default_factory=list)
    rode: list[int] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    more: bool = False


class RunStage:
    """Runs step plans on `runner`: `run` (one loop over a plan's steps, here or on the engine thread)."""

    def __init__(self, runner, kv, speculator: Speculator, overlap: bool):
        self.runner, self.kv, self.speculator = runner, kv, speculator
        # overlap: the engine calls run here while the executor's thread renders the last step's text
        self.engine = ThreadPoolExecutor(1, thread_name_prefix="engine-call") if overlap else None
        self.stop = False  # set by the executor's thread when a plan's later steps are no longer wanted

    def can_run_ahead(self, plan: StepPlan) -> bool:
        """Whether the plan's decode rows can run several steps back to back: each row's next token comes from
        the sampling head on the engine thread (ArgMax, or a draw from the TopK candidates) and none speculates
        (whether the plan is decode-only, with no request waiting for a row, is Scheduler.run_ahead's to say)."""
        return all(s.speculation is None for s in plan.decode) and head_for(self.runner, plan.decode) != "logits"

    def run(self, plan: StepPlan, meanwhile: Callable[[], None], between: Callable[[StepRun], bool]) -> StepRun:
        """Run `plan`'s steps. `meanwhile()` runs on this thread while a step's calls run (before them, without
        an engine thread); each step but the last goes to `between(ran)` (the executor records it and says whether
        the plan's later steps are still wanted). Returns the last step's StepRun (recorded with the next plan)."""
        if plan.empty:
            meanwhile()
            return StepRun()
        steps: queue.SimpleQueue = queue.SimpleQueue()
        self.stop = False
        if self.engine is None:  # one step (ExecutorConfig refuses a lookahead without overlap), run here
            meanwhile()
            self._steps(plan, steps.put)
        else:
            self.engine.submit(self._steps, plan, steps.put)
            meanwhile()
        while True:  # until the engine thread says no step follows
            ran = steps.get()
            if isinstance(ran, BaseException):
                raise ran
            if not ran.more:
                return ran
            self.stop = between(ran)
            meanwhile()

    def _steps(self, plan: StepPlan, put: Callable) -> None:
        """The plan's steps, each StepRun `put` at once (the executor's thread wakes while the next call is prepared):
        the first step's calls are laid out from the sequences' state (a paged engine's block ids copied then: the
        scheduler reserved the blocks of every step), the later ones from the last step's outputs alone (each
        row's chosen token at its next position), so this thread reads no state the executor's thread changes
        meanwhile. A failed call ends the plan with its rows' errors; a bug goes to `put` as the exception."""
        try:
            ran = StepRun(started=time.perf_counter())
            calls = self._first(plan, ran)
            for step in range(2, plan.steps + 2):
                ran.more = step <= plan.steps and not self.stop and all(row.error is None for row in ran.rows)
                ran.ended = time.perf_counter()
                put(ran)
                if not ran.more:
                    return
                chosen = {row.seq.id: row.tokens[0] for row in ran.rows}  # no row failed: each has its token
                for call in calls:
                    call.advance(chosen)
                ran = StepRun(self._decode(calls, plan.decode), ran.rode, ran.started)
        except BaseException as err:  # a bug, not a failed call: the executor's thread raises it
            put(err)

    def _first(self, plan: StepPlan, ran: StepRun) -> list:
        """Run the plan's first step into `ran`: its decode rows (batched, or a speculative verify call of their
        own) and prompt chunks. Returns the decode calls (a plan of several steps has nothing else)."""
        plain, speculative, rows = self._propose(plan.decode)
        calls = self.kv.calls(self.runner, plain, plan.prefill)
        prompted = next((i for i, call in enumerate(calls) if call.prompts), len(calls))
        decoded = self._timed_decode(calls[:prompted], plain) if prompted else []
        prompts = [row for call in calls[prompted:] for row in run_call(call, self.runner)]
        if len(decoded) < len(plain):  # decode rows in a call with prompt chunks (a paged engine's packed call)
            decoded, prompts = [r for r in prompts if not r.prompt], [r for r in prompts if r.prompt]
        if rows or speculative:  # rows that left the batched call: all back in the plan's order
            order = {s.id: i for i, s in enumerate(plan.decode)}
            rows += [self._verify(seq, drafts, probs) for seq, drafts, probs in speculative]
            decoded = sorted(rows + decoded, key=lambda row: order[row.seq.id])
        ran.rows, ran.rode = decoded + prompts, [row for call in calls[:prompted] for row in call.rode]
        return calls[:prompted]

    def _propose(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[tuple], list[StepResult]]:
        """Split decode rows: speculating rows with a draft get their own verify call; rows
        without speculation, without a draft this step, or whose drafting does not pay (measured
        costs, see Speculator.should_draft) join the batched decode call. A failed proposal is its row's error."""
        plain, speculative, failed = [], [], []
        for seq in seqs:
            if seq.speculation is None or not self.speculator.should_draft(seq, len(seqs)):
                plain.append(seq)
                continue
            try:
                drafts, probs = self.speculator.propose(seq)
            except Exception as err:
                failed.append(StepResult(seq, error=err))
                continue
            if drafts:
                speculative.append((seq, drafts, probs))
            else:
                plain.append(seq)
        return plain, speculative, failed

    def _timed_decode(self, calls: list, seqs: list[Sequence]) -> list[StepResult]:
        """`_decode`, its time observed as a plain decode step's cost (draft_policy.StepCosts)."""
        shapes, start = self.runner.new_call_shapes, time.perf_counter()
        rows = self._decode(calls, seqs)
        if self.runner.new_call_shapes == shapes:  # a call that binds a new shape is not typical
            self.speculator.costs.observe_plain(len(seqs), time.perf_counter() - start)
        return rows

    def _decode(self, calls: list, seqs: list[Sequence]) -> list[StepResult]:
        """Each of `seqs`' StepResult from decode-only `calls`, in the order of `seqs`. On contiguous rows, slots in
        between that are not in a call (free, still prefilling, or speculating) ride along with a dummy token
        written just past their valid KV, which their next call overwrites and nothing reads. A failed call fails
        only its rows."""
        if len(calls) == 1 and calls[0].seqs is seqs:
            return run_call(calls[0], self.runner)
        return in_order([row for call in calls for row in run_call(call, self.runner)], seqs)

    def _verify(self, seq: Sequence, drafts: list[int], probs) -> StepResult:
        """A speculating row's verify call: the tokens it accepted (the last token and the accepted drafts
        are cached)."""
        try:
            tokens = self.speculator.verify(seq, drafts, probs, self.kv.place(seq))
        except Exception as err:
            return StepResult(seq, error=err)
        return StepResult(seq, len(tokens), tokens=tokens)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
