"""Greedy decode tokens/s of an engine, the one way every harness times it, and the pieces around it.

Our engine is timed through the runtime's public path (`LLM.make_sequence` + the executor), as a user
runs it: each row is a sequence, all submitted at once; decode time runs from the last row's first token to
the end, so prefill is excluded. Used by tools.bench.decode, revisions, tp_decode and tools.gpu.check.
The code reads only the runtime's public API, so revisions can run it against an older runtime."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Timing:
    """One generation: seconds from the call to every row's first token, and to the end; each row's tokens."""

    first_token_s: float
    total_s: float
    token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def decode_s(self) -> float:
        return self.total_s - self.first_token_s


def int_list(text: str) -> tuple[int, ...]:
    """Positive integers from "1,4,16" (batch sizes, concurrencies); ValueError naming the text otherwise."""
    values = tuple(int(v) for v in str(text).split(",") if v.strip())
    if not values or min(values) < 1:
        raise ValueError(f"{text!r}: give positive integers separated by commas, e.g. 1,4,16")
    return values


def synthetic_prompts(rng: np.random.Generator, batch: int, prompt_len: int, vocab: int) -> np.ndarray:
    """[batch, prompt_len] token ids drawn above the special ids (0-3), so no row starts with BOS/EOS."""
    return rng.integers(4, vocab, (batch, prompt_len))


def timed_generate(llm, prompts, new_tokens: int) -> Timing:
    """Greedy-generate exactly `new_tokens` tokens for every row of `prompts` (rows of token ids) at once."""
    params = _sampling_params()(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    seqs = [llm.make_sequence([int(t) for t in row], params) for row in prompts]
    results = [h.result() for h in [llm.executor.submit_sequence(s) for s in seqs]]
    end = time.perf_counter()
    lengths = [len(r.token_ids) for r in results]
    if any(n != new_tokens for n in lengths):
        raise RuntimeError(f"generated {lengths} tokens, wanted {new_tokens} per row")
    return Timing(max(s.first_token_time for s in seqs) - start, end - start, [r.token_ids for r in results])


def _sampling_params() -> type:
    """SamplingParams of the runtime on sys.path: runtime/params.py before the runtime's packages, then
    runtime/request/params.py (the older layout is tried first: a newer install can shadow its absence)."""
    try:
        from runtime.params import SamplingParams
    except ImportError:
        from runtime.request.params import SamplingParams
    return SamplingParams


def decode_tok_s(batch: int, new_tokens: int, timing: Timing) -> float:
    """Tokens/s after the first token: every row decodes new_tokens - 1 tokens in timing.decode_s."""
    return batch * (new_tokens - 1) / timing.decode_s


def median_decode_tok_s(llm, prompts, new_tokens: int, runs: int) -> float:
    """The median over `runs` timed generations of the same prompts, after one warm-up (binds call shapes,
    captures CUDA graphs)."""
    timed_generate(llm, prompts, new_tokens)
    return statistics.median(decode_tok_s(len(prompts), new_tokens, timed_generate(llm, prompts, new_tokens))
                             for _ in range(runs))
