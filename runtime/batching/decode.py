"""A step's engine calls, their inputs fixed when the KV table (runtime/batching/kv_table.py) lays them out, and
what each sequence's row produced (`StepResult`, which runtime/batching/executor.py records in postprocess): on
contiguous rows a batched decode call over a range of slots in use (split around idle rows that keep much KV; or
rows [0, bucket) on fixed buffers) and one call per prompt chunk; on a paged engine one packed call over every
row. A call reads the sampling-head output the step needs (`head_for`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.request.sampler import candidates_suffice, sample_candidates
from runtime.request.sequence import Sequence
from runtime.speculation.eagle import feeds_head

# idle rows' cached tokens inside a decode call worth a call of its own (_runs; measured on a CPU
# with a hidden-512 model: a call that binds a new shape costs ~0.5-0.8 ms, attention ~0.4 us per cached token)
SPLIT_KV = 2048


@dataclass(slots=True)
class StepResult:
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
    features: np.ndarray | None = None  # [cached, hidden]: an EAGLE row's target features there (eagle.feeds_head)


@dataclass(slots=True)
class DecodeCall:
    """One decode call over contiguous rows, its inputs fixed before it runs: rows from slot `start`, each
    sequence's row in it, the token and position per row, the idle rows riding along with a dummy token, and the
    sampling-head output it reads. `advance` turns it into the next step's call for the same rows."""

    start: int
    seqs: list[Sequence]
    rows: list[int]
    tokens: np.ndarray  # int64 [rows]
    past: np.ndarray  # int64 [rows]: the position each row writes
    rode: list[int]
    head: str = "logits"
    features: list[int] | None = None  # the call's rows whose target features are returned too (EAGLE rows)
    prompts = 0  # prompt chunks in the call

    def run(self, runner) -> list[StepResult]:
        use_adapters(runner, self.seqs)
        if self.features is None:
            return _rows(self.seqs, runner.decode(self.start, self.tokens, self.past, self.head), self.rows, self.head)
        out, hidden = runner.decode(self.start, self.tokens, self.past, self.head, np.array(self.features))
        rows = _rows(self.seqs, out, self.rows, self.head)
        at = {row: i for i, row in enumerate(self.features)}
        for result, row in zip(rows, self.rows):
            if row in at:
                result.features = hidden[at[row]:at[row] + 1]
        return rows

    def failed(self, err: Exception) -> list[StepResult]:
        return [StepResult(s, error=err) for s in self.seqs]

    def advance(self, chosen: dict[int, int]) -> None:
        """The same rows one token further, in place: each sequence's row takes the token chosen for it (by
        sequence id) at the next position; idle rows ride along again where they were."""
        self.tokens[self.rows] = [chosen[s.id] for s in self.seqs]
        self.past[self.rows] += 1


@dataclass(slots=True)
class ChunkCall:
    """A prompt chunk of `n` tokens on one contiguous row. The chunk that completes the prompt gives the first
    token: a greedy row's from the graph's ArgMax (it never reads the full logits), else the logits to sample
    from; an earlier chunk reads the cheapest output the engine has, and nothing of it."""

    seq: Sequence
    n: int
    rode = ()
    prompts = 1

    @property
    def seqs(self) -> list[Sequence]:
        return [self.seq]

    def run(self, runner) -> list[StepResult]:
        seq, n = self.seq, self.n
        last, scored = n == seq.num_uncached_prompt, seq.params.prompt_logprobs is not None  # scored: every position
        greedy = head_for(runner, [seq]) == "next_token" if last else runner.has_next_token and not scored
        use_adapters(runner, [seq])
        features = feeds_head(runner, seq)  # an EAGLE row: the head drafts from the prompt's features
        out = runner.extend(seq.slot, seq.num_cached, seq.prefill_ids[seq.num_cached:seq.num_cached + n],
                            all_logits=scored, head="next_token" if greedy else "logits", features=features)
        out, hidden = out if features else (out, None)
        row = StepResult(seq, n, prompt=True, prompt_logits=out if scored else None, features=hidden)
        if last:
            row.tokens, row.logits = ([int(out[-1])], None) if greedy else (None, out[-1])
        return [row]

    def failed(self, err: Exception) -> list[StepResult]:
        return [StepResult(self.seq, error=err, prompt=True)]


@dataclass(slots=True)
class PackedCall:
    """One packed call of a paged engine over exactly its rows, decode rows first and then the last `prompts`
    rows' prompt chunks: each row's KV (`PagedRow`, block ids copied when the call was laid out), position and
    new tokens. A call with prompt chunks reads logits; a decode-only call `advance`s like DecodeCall."""

    seqs: list[Sequence]
    kv: list  # PagedRow per row
    past: list[int]
    new: list[list[int]]
    prompts: int
    head: str = "logits"
    rode = ()

    def run(self, runner) -> list[StepResult]:
        out = runner.step(self.kv, self.past, self.new, self.head)
        decoded = len(self.seqs) - self.prompts
        rows = _rows(self.seqs[:decoded], out, range(decoded), self.head) if decoded else []
        for i, seq in enumerate(self.seqs[decoded:], start=decoded):
            n = len(self.new[i])
            rows.append(StepResult(seq, n, logits=out[i] if n == seq.num_uncached_prompt else None, prompt=True))
        return rows

    def failed(self, err: Exception) -> list[StepResult]:
        decoded = len(self.seqs) - self.prompts
        return [StepResult(s, error=err, prompt=i >= decoded) for i, s in enumerate(self.seqs)]

    def advance(self, chosen: dict[int, int]) -> None:
        self.new = [[chosen[s.id]] for s in self.seqs]
        self.past = [p + 1 for p in self.past]


def use_adapters(runner, seqs: list[Sequence]) -> None:
    """Each sequence's KV row runs on its LoRA adapter (SamplingParams.adapter) in the call about to run."""
    pool = runner.lora  # None: an engine without LoRA inputs
    for seq in seqs if pool is not None else ():
        pool.assign(seq.slot, seq.params.adapter)


def run_call(call, runner) -> list[StepResult]:
    """A call's Rows; a failed call fails only its rows."""
    try:
        return call.run(runner)
    except Exception as err:
        return call.failed(err)


def in_order(rows: list[StepResult], seqs: list[Sequence]) -> list[StepResult]:
    """`rows` (one per sequence) in the order of `seqs`."""
    by_id = {row.seq.id: row for row in rows}
    return [by_id[s.id] for s in seqs]


def decode_calls(runner, slots, seqs: list[Sequence]) -> list[DecodeCall]:
    """The calls of a decode step over `seqs` on contiguous rows (`slots`: their SlotTable): one per run of rows
    (`_runs`), or rows [0, bucket) on fixed buffers (CUDA graphs)."""
    head = head_for(runner, seqs)
    bucket = runner.bucket(max(s.slot for s in seqs) + 1)
    if bucket is not None:  # fixed-buffer (CUDA-graph) decode: rows [0, bucket), the rest ride along
        return [_call(runner, slots, sorted(seqs, key=lambda s: s.slot), 0, bucket - 1, head)]
    runs = _runs(slots, seqs)
    if len(runs) == 1 and runs[0] == seqs:  # one call, rows already in slot order (the common step)
        return [_call(runner, slots, seqs, seqs[0].slot, seqs[-1].slot, head)]
    return [_call(runner, slots, run, run[0].slot, run[-1].slot, head) for run in runs]


def _runs(slots, seqs: list[Sequence]) -> list[list[Sequence]]:
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


def _call(runner, slots, seqs: list[Sequence], lo: int, hi: int, head: str) -> DecodeCall:
    """The call over rows [lo, hi] for `seqs`, which are in slot order."""
    past = slots.positions(lo, hi)
    rows, ids = [s.slot - lo for s in seqs], [s.token(s.num_cached) for s in seqs]
    features = [s.slot - lo for s in seqs if feeds_head(runner, s)] or None
    if len(rows) == len(past):  # every row of the call decodes
        return DecodeCall(lo, seqs, rows, np.array(ids, dtype=np.int64), past, [], head, features)
    tokens = np.zeros(len(past), dtype=np.int64)  # idle rows ride along with a dummy token
    tokens[rows] = ids
    return DecodeCall(lo, seqs, rows, tokens, past, sorted(set(range(lo, hi + 1)) - {s.slot for s in seqs}), head,
                      features)


def _rows(seqs: list[Sequence], result, rows, head: str) -> list[StepResult]:
    """Each sequence's StepResult from a decode call's outputs (`rows`: its row in them)."""
    if head == "next_token":
        chosen = result.tolist()
        return [StepResult(s, 1, tokens=[chosen[r]]) for s, r in zip(seqs, rows)]
    if head == "topk":
        return [draw_candidate(s, result[0][r], result[1][r]) for s, r in zip(seqs, rows)]
    return [StepResult(s, 1, logits=result[r]) for s, r in zip(seqs, rows)]


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


def draw_candidate(seq: Sequence, values: np.ndarray, ids: np.ndarray) -> StepResult:
    try:
        return StepResult(seq, 1, tokens=[sample_candidates(values, ids, seq.params, seq.rng)])
    except Exception as err:  # only this row fails (its KV was computed): the executor's postprocess ends it
        return StepResult(seq, 1, error=err)
