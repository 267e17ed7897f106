"""Sequence: one request's tokens, sampling state, text stream, timings and finish reason."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
from tokenizers import Tokenizer

from runtime.request.detokenizer import TextStream
from runtime.request.logprobs import Scores
from runtime.request.params import SamplingParams
from runtime.request.sampler import make_rng
from runtime.request.structured import Guide

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"      # queued, no KV slot yet (or preempted: its slot taken back)
    PREFILL = "prefill"      # has a slot, prompt (and after a preemption its generated tokens) not fully cached
    DECODE = "decode"        # producing one token per step
    FINISHED = "finished"


@dataclass
class Sequence:
    """A prompt being completed. The KV cache holds its first `num_cached` tokens in `slot`; both,
    `reused` and `recomputed`, are read-only here: the scheduler's slot table (runtime/batching/slot_table.py)
    writes them, and `status` follows from them."""

    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    error: str | None = None
    text: str = ""
    # a SpecState (runtime/speculation/speculator.py, a layer above: not imported here) when the request speculates
    speculation: object = None

    def __post_init__(self) -> None:
        self.id = next(_ids)
        self.rng = make_rng(self.params.seed)
        self.stream = TextStream(self.tokenizer, self.params.stop, self.prompt_ids)
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self._reason: str | None = None  # why it ended: written by `finish` alone (the executor's one end)
        # written only by the scheduler's KV table (runtime/batching/kv_table.py, slot_table.py)
        self._slot, self._cached, self._reused = -1, 0, 0
        self._blocks: list[int] = []  # its KV blocks, the KV table's list for its row (which grows it)
        self._recomputed = 0  # generated tokens prefilled again after a preemption
        self.stopped_at: int | None = None  # the output index whose text completed a stop string
        self.scores = Scores(self.params, len(self.prompt_ids)) if self.params.full_logits else None  # logprobs
        self.guide: Guide | None = None  # the structured-output constraint's state (set by LLM when it validates)

    @property
    def finish_reason(self) -> str | None:
        """Why it ended (stop | length | cancelled | error), None while it runs. Text that completed a stop string
        (`stopped_at`) says "stop" from then on, whatever `finish` was told: the request's text ends there."""
        return "stop" if self.stopped_at is not None else self._reason

    @property
    def status(self) -> Status:
        """Derived: finished once it has a finish reason, waiting until it has a slot, then prefilling
        until its whole prompt is cached."""
        if self._reason is not None or self.stopped_at is not None:  # finish_reason, without a second property call
            return Status.FINISHED
        if self._slot < 0:
            return Status.WAITING
        return Status.PREFILL if self._cached < len(self.prompt_ids) + self._recomputed else Status.DECODE

    @property
    def slot(self) -> int:
        return self._slot

    @property
    def num_cached(self) -> int:
        return self._cached

    @property
    def blocks(self) -> list[int]:
        """The ids of the KV blocks holding its tokens, in token order (a paged engine's are the device pool's);
        empty while it has no row. The KV table's own list: read it, copy it to keep it."""
        return self._blocks

    @property
    def reused(self) -> int:
        """Leading prompt tokens whose KV was found in the cache when the sequence got its slot."""
        return self._reused

    @property
    def recomputed(self) -> int:
        """Generated tokens that are prefilled with the prompt: those it had when it was last preempted."""
        return self._recomputed

    @property
    def prefill_ids(self) -> list[int]:
        """What is prefilled before decoding: the prompt, then the tokens generated before a preemption."""
        return self.prompt_ids + self.output_ids[:self._recomputed] if self._recomputed else self.prompt_ids

    @property
    def finished(self) -> bool:
        return self._reason is not None or self.stopped_at is not None  # finish_reason is not None, read per step

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_uncached_prompt(self) -> int:
        return len(self.prompt_ids) + self._recomputed - self.num_cached

    def token(self, index: int) -> int:
        """all_ids[index] without building all_ids (a decode step reads one token per row)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    def history(self) -> np.ndarray:
        return np.asarray(self.all_ids, dtype=np.int64)

    def accept(self, token: int) -> str | None:
        """Record a generated token id; returns why the sequence ends with it: "stop" at EOS, "length" at
        max_new_tokens, else None. Ending it is the executor's (runtime/batching/executor.py `_finish` calls
        `finish`); its text is `render`'s work, which may come later (during the next engine call)."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_ids.append(token)
        if token in self.eos_ids and not self.params.ignore_eos:
            return "stop"
        return "length" if len(self.output_ids) >= self.params.max_new_tokens else None

    def render(self, index: int) -> str:
        """The text output_ids[index] completes (called once per index, in order, after accept). Text that
        completes a stop string stops there (`stopped_at`: the executor ends the sequence, and the tokens after it
        are dropped by `drop_after_stop`); the last token of an ended sequence brings the held-back tail too."""
        if self.stopped_at is not None:
            return ""
        token, last = self.output_ids[index], index == len(self.output_ids) - 1
        if token in self.eos_ids and not self.params.ignore_eos:
            return self._tail()
        delta, stopped = self.stream.push(token)
        self.text += delta
        if stopped:
            self.stopped_at = index
            return delta
        return delta + self._tail() if last and self._reason == "length" else delta

    def drop_after_stop(self) -> int:
        """Drop the tokens accepted after the one that completed a stop string (a verify's later tokens, or with
        the executor's overlap a later step's); returns how many."""
        if self.stopped_at is None:
            return 0
        dropped = len(self.output_ids) - self.stopped_at - 1
        del self.output_ids[self.stopped_at + 1:]
        return dropped

    def _tail(self) -> str:
        tail = self.stream.finish(drop_incomplete=self.finish_reason == "length")  # cut mid-character: no U+FFFD
        self.text += tail
        return tail

    def finish(self, reason: str, error: str | None = None) -> None:
        """End the sequence (stop | length | cancelled | error): the one writer of why it ended, called by the
        executor alone. Text held back for a stop or a length comes with its last token's `render`."""
        self._reason, self.finish_time, self.error = reason, time.perf_counter(), error

    def metrics(self) -> dict:
        """Time to first token, time per output token (seconds) and token counts."""
        n = len(self.output_ids)
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        tpot = None
        if n > 1 and self.finish_time is not None and self.first_token_time is not None:
            tpot = (self.finish_time - self.first_token_time) / (n - 1)
        return {"ttft_s": ttft, "tpot_s": tpot, "prompt_tokens": len(self.prompt_ids), "output_tokens": n,
                "reused_prompt_tokens": self.reused,
                "latency_s": None if self.finish_time is None else self.finish_time - self.arrival,
                "speculation": None if self.speculation is None else self.speculation.stats()}
