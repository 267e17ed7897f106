"""Sequence: one request's tokens, sampling state, text stream and finish reason."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from runtime.detokenizer import TextStream
from runtime.params import SamplingParams
from runtime.sampler import make_rng


@dataclass
class Sequence:
    """A prompt being completed. The KV cache holds `num_cached` of its tokens in `slot`."""

    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1
    num_cached: int = 0
    finish_reason: str | None = None
    text: str = ""

    def __post_init__(self) -> None:
        self.rng = make_rng(self.params.seed)
        self.stream = TextStream(self.tokenizer, self.params.stop, self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def history(self) -> np.ndarray:
        return np.asarray(self.all_ids, dtype=np.int64)

    def append(self, token: int) -> str:
        """Record a sampled token; returns the new text and sets finish_reason when done."""
        self.output_ids.append(token)
        if token in self.eos_ids and not self.params.ignore_eos:
            return self._finish("stop")
        delta, stopped = self.stream.push(token)
        self.text += delta
        if stopped:
            self.finish_reason = "stop"
            return delta
        if len(self.output_ids) >= self.params.max_new_tokens:
            return delta + self._finish("length")
        return delta

    def _finish(self, reason: str) -> str:
        self.finish_reason = reason
        tail = self.stream.finish()
        self.text += tail
        return tail
