"""A runner without a model, to drive the executor alone (tests; tools/bench/kv_overhead.py, step_breakdown.py):
rows of contiguous KV like runtime/model/runner.py's Runner, whose next token after t is (t + 1) % vocab, from
its sampling head or as one-hot logits, at no cost; it can record its calls."""
from __future__ import annotations

import numpy as np

from runtime.manifest.kv_spec import KVCacheSpec
from runtime.model.kv_cache import KVCache


class CountingRunner:
    """`slots` KV rows of `max_seq_len` tokens (a one-layer cache of two floats a token); with `record`, each
    call's (kind, row, past) in `calls`: ("extend", row, past_len, tokens) or ("decode", first row, past_lens)."""

    has_next_token, top_k, new_call_shapes = True, 0, 0
    lora = None  # no LoRA inputs (runtime/model/runner.py EngineRunner.lora)
    has_hidden = False  # no EAGLE features output (EngineRunner.has_hidden)

    def __init__(self, slots: int = 2, max_seq_len: int = 16, vocab: int = 32, record: bool = True):
        self.cache = KVCache(KVCacheSpec(num_layers=1, kv_heads=1, head_dim=2, dtype="float32", slots=slots,
                                         max_seq_len=max_seq_len))
        self.spec, self.vocab, self.record, self.calls = self.cache.spec, vocab, record, []

    def bucket(self, rows: int) -> None:
        return None

    def extend(self, slot: int, past_len: int, tokens: list[int], all_logits: bool = False,
               head: str = "logits", features: bool = False) -> np.ndarray:
        """Every new token's successor with `all_logits`, else the last one's: [n] ids or [n, vocab] logits (no
        `features`: it has no EAGLE output, has_hidden is False)."""
        if features:
            raise ValueError("the fake runner has no hidden_states output")
        if self.record:
            self.calls.append(("extend", slot, past_len, len(tokens)))
        return self._next(np.asarray(tokens if all_logits else tokens[-1:]), head)

    def decode(self, start: int, tokens: np.ndarray, past_lens: np.ndarray, head: str = "logits") -> np.ndarray:
        if self.record:
            self.calls.append(("decode", start, past_lens.tolist()))
        return self._next(np.asarray(tokens), head)

    def _next(self, tokens: np.ndarray, head: str) -> np.ndarray:
        following = (tokens + 1) % self.vocab  # [n]
        return following if head == "next_token" else np.eye(self.vocab, dtype=np.float32)[following]  # [n, vocab]
