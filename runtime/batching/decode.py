"""A step's batched decode call: which calls cover the decode rows (one over the range of slots in use, split
around idle rows that keep much KV; or rows [0, bucket) on fixed buffers), the sampling-head output it reads,
and what each sequence's row produced (`Row`, which runtime/batching/executor.py records in postprocess)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.batching.slot_table import SlotTable
from runtime.request.sampler import candidates_suffice, sample_candidates
from runtime.request.sequence import Sequence

# idle rows' cached tokens inside a decode call worth a call of its own (_runs; measured on a CPU
# with a hidden-512 model: a call that binds a new shape costs ~0.5-0.8 ms, attention ~0.4 us per cached token)
SPLIT_KV = 2048


@dataclass(slots=True)
class Row:
    """What one sequence's row of a step's run produced: `cached`, the tokens its call computed into the
    KV cache (recorded as progress in postprocess), and then the logits to sample its next token from,
    the tokens already chosen (a sampling head's pick, or a verify's accepted tokens), neither (a prompt
    chunk short of the prompt's end), or the `error` its call or its candidate draw raised."""

    seq: Sequence
    cached: int = 0
    logits: np.ndarray | None = None  # [vocab]
    tokens: list[int | None] | None = None
    error: Exception | None = None
    prompt: bool = False  # a prompt chunk
    prompt_logits: np.ndarray | None = None  # [cached, vocab]: a chunk's logits at every position (prompt logprobs)


@dataclass(slots=True)
class DecodeCall:
    """One engine call of a decode step, its inputs fixed before it runs: rows from slot `start` (None: a
    packed call over exactly `slots`), each sequence's row in it, the token and position per row, and the idle
    rows riding along with a dummy token. `advance` turns it into the next step's call for the same rows."""

    start: int | None
    seqs: list[Sequence]
    rows: list[int]
    tokens: np.ndarray  # int64 [rows]
    past: np.ndarray  # int64 [rows]: the position each row writes
    rode: list[int]
    slots: list[int] | None = None  # a packed call's rows
    blocks: list[list[int]] | None = None  # a packed call's block ids, read when it was planned (`frozen`)

    def run(self, runner, head: str) -> list[Row]:
        if self.slots is not None:
            return _rows(self.seqs, runner.decode_rows(self.slots, self.tokens.tolist(), self.past.tolist(), head,
                                                       self.blocks), self.rows, head)
        return _rows(self.seqs, runner.decode(self.start, self.tokens, self.past, head), self.rows, head)

    def advance(self, chosen: dict[int, int]) -> None:
        """The same rows one token further, in place: each sequence's row takes the token chosen for it (by
        sequence id) at the next position; idle rows ride along again where they were."""
        self.tokens[self.rows] = [chosen[s.id] for s in self.seqs]
        self.past[self.rows] += 1


def decode_calls(runner, slots: SlotTable, seqs: list[Sequence], frozen: bool = False) -> list[DecodeCall]:
    """The calls of a decode step over `seqs`: one per run of rows (`_runs`), or rows [0, bucket) on fixed
    buffers (CUDA graphs), or for a paged engine one packed call over exactly these rows (`frozen`: with their
    block ids read now, for steps run ahead while the scheduler's tables change)."""
    if getattr(runner, "packed", False):
        held = [s.slot for s in seqs]
        return [DecodeCall(None, seqs, list(range(len(seqs))), np.array([s.token(s.num_cached) for s in seqs], np.int64),
                           np.array([s.num_cached for s in seqs], np.int64), [], held,
                           runner.block_ids(held) if frozen else None)]
    bucket = runner.bucket(max(s.slot for s in seqs) + 1)
    if bucket is not None:  # fixed-buffer (CUDA-graph) decode: rows [0, bucket), the rest ride along
        return [_call(slots, sorted(seqs, key=lambda s: s.slot), 0, bucket - 1)]
    runs = _runs(slots, seqs)
    if len(runs) == 1 and runs[0] == seqs:  # one call, rows already in slot order (the common step)
        return [_call(slots, seqs, seqs[0].slot, seqs[-1].slot)]
    return [_call(slots, run, run[0].slot, run[-1].slot) for run in runs]


def run_calls(runner, calls: list[DecodeCall], seqs: list[Sequence], head: str) -> list[Row]:
    """Each sequence's Row from `calls`, in the order of `seqs`."""
    if len(calls) == 1 and calls[0].seqs is seqs:
        return calls[0].run(runner, head)
    rows = {}
    for call in calls:
        rows.update(zip((s.id for s in call.seqs), call.run(runner, head)))
    return [rows[s.id] for s in seqs]


def decode_call(runner, slots: SlotTable, seqs: list[Sequence], rode: list[int]) -> list[Row]:
    """One decode step over `seqs` (decode_calls, run); `rode` gets the idle rows its calls covered."""
    calls = decode_calls(runner, slots, seqs)
    for call in calls:
        rode += call.rode
    return run_calls(runner, calls, seqs, head_for(runner, seqs))


def _runs(slots: SlotTable, seqs: list[Sequence]) -> list[list[Sequence]]:
    """The decode rows by slot, split where the idle rows between two of them keep more than SPLIT_KV
    cached tokens: a dummy token there attends over all of them, which then costs more than a call of
    its own (an empty idle row costs one token and rides along)."""
    ordered = sorted(seqs, key=lambda s: s.slot)
    runs = [[ordered[0]]]
    for prev, seq in zip(ordered, ordered[1:]):
        if seq.slot > prev.slot + 1 and slots.positions(prev.slot + 1, seq.slot - 1).sum() > SPLIT_KV:
            runs.append([])
        runs[-1].append(seq)
    return runs


def _call(slots: SlotTable, seqs: list[Sequence], lo: int, hi: int) -> DecodeCall:
    """The call over rows [lo, hi] for `seqs`, which are in slot order."""
    past = slots.positions(lo, hi)
    rows, ids = [s.slot - lo for s in seqs], [s.token(s.num_cached) for s in seqs]
    if len(rows) == len(past):  # every row of the call decodes
        return DecodeCall(lo, seqs, rows, np.array(ids, dtype=np.int64), past, [])
    tokens = np.zeros(len(past), dtype=np.int64)  # idle rows ride along with a dummy token
    tokens[rows] = ids
    return DecodeCall(lo, seqs, rows, tokens, past, sorted(set(range(lo, hi + 1)) - {s.slot for s in seqs}))


def _rows(seqs: list[Sequence], result, rows, head: str) -> list[Row]:
    """Each sequence's Row from a decode call's outputs (`rows`: its row in them)."""
    if head == "next_token":
        chosen = result.tolist()
        return [Row(s, 1, tokens=[chosen[r]]) for s, r in zip(seqs, rows)]
    if head == "topk":
        return [draw_candidate(s, result[0][r], result[1][r]) for s, r in zip(seqs, rows)]
    return [Row(s, 1, logits=result[r]) for s, r in zip(seqs, rows)]


def head_for(runner, seqs: list[Sequence]) -> str:
    """The engine outputs a decode call reads: the graph's ArgMax when every row is greedy without a
    penalty, its TopK candidates when every row samples with top_k in 1..K and no penalty, else the
    full logits (repetition penalty, top_k 0 or above K, log-probabilities asked for, or an engine without a
    sampling head)."""
    if runner.has_next_token and all(s.params.greedy and s.params.repetition_penalty == 1.0 and not s.params.full_logits
                                     for s in seqs):
        return "next_token"
    if runner.top_k and all(candidates_suffice(s.params, runner.top_k) for s in seqs):
        return "topk"
    return "logits"


def draw_candidate(seq: Sequence, values: np.ndarray, ids: np.ndarray) -> Row:
    try:
        return Row(seq, 1, tokens=[sample_candidates(values, ids, seq.params, seq.rng)])
    except Exception as err:  # only this row fails (its KV was computed): the executor's postprocess ends it
        return Row(seq, 1, error=err)
