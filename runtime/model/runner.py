"""Runner: what the executor and the speculator call on an engine. `EngineRunner` is what every runner has
(its KV cache, its sampling-head outputs); `Runner` runs rows of contiguous KV slots, shared by the one-session
ModelRunner and the tensor-parallel rank-0 runner (neither relies on the other's state); a paged engine's
runner (runtime/model/paged_runner.py) runs packed calls over block tables instead. Which one an engine has is
chosen once at load (runtime/engine.py), and the KV table that lays out its calls with it
(runtime/batching/kv_table.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.model.kv_cache import KVCache
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import Manifest

PROMPT_BUCKETS = tuple(2**i for i in range(4, 17))  # 16 .. 65536 tokens: the lengths padded prompt calls run at


class EngineRunner:
    """What every runner has: the engine, its KV `cache`, its sampling-head outputs (`has_next_token`, `top_k`:
    none here) and `new_call_shapes`, the call shapes bound so far (a call that binds a new shape is slower than
    the next of its shape). Each kind adds `extend(kv, past_len, tokens, all_logits, head)`, where `kv` is what
    the KV table's `place(seq)` says of a sequence's KV (a row here, a block table for a paged engine)."""

    new_call_shapes: int
    prompt_buckets: tuple[int, ...] = ()  # the lengths multi-token calls are padded to (Runner.padded); none here
    lora = None  # an engine built with `lora:` has its AdapterPool here (runtime/lora/pool.py)
    scores_prompts = True  # a prompt chunk's call can return every position's logits (prompt_logprobs)

    def __init__(self, engine_dir: Path, manifest: Manifest, spec: KVCacheSpec, cache):
        self.engine_dir, self.manifest, self.spec, self.dtype = engine_dir, manifest, spec, spec.dtype
        self.vocab_size = manifest.vocab_size
        self.cache = cache
        self.has_next_token, self.top_k = False, 0
        self.has_hidden = False  # an engine built for an EAGLE head outputs its last hidden state

    def _check_head(self, head: str) -> None:
        if head == "next_token" and not self.has_next_token or head == "topk" and not self.top_k \
                or head == "hidden" and not self.has_hidden:
            raise ValueError(f"this engine has no sampling head output for {head!r}; use head='logits'")

    def warm_prompt_shapes(self, longest: int) -> int:
        """Run each prompt bucket up to `longest` tokens once (none here); returns the shapes run."""
        return 0

    def close(self) -> None:
        """Release what the runner started (nothing here); idempotent."""


class Runner(EngineRunner):
    """Runs the engine on rows `[start, stop)` of its KV cache; a subclass implements `run`.

    A call is either a first prompt for all its rows (seq > 1, positions from 0), a decode step
    (seq == 1, each row at its own length) or, at batch 1, a chunk on top of an existing past.
    `graph_buckets`: decode batch sizes run on fixed buffers (none here)."""

    def __init__(self, engine_dir: Path, manifest: Manifest, spec: KVCacheSpec, cache: KVCache,
                 prompt_buckets: bool = False):
        """`prompt_buckets` (LoadConfig.buckets_on): multi-token calls run padded to PROMPT_BUCKETS lengths."""
        super().__init__(engine_dir, manifest, spec, cache)
        self.graph_buckets: list[int] = []
        self.prompt_buckets = tuple(b for b in PROMPT_BUCKETS if b <= spec.max_seq_len) if prompt_buckets else ()

    def run(self, start: int, input_ids: np.ndarray, seqlens_k: np.ndarray, total_len: int,
            logits_index: np.ndarray, head: str = "logits", features: np.ndarray | None = None):
        """input_ids [rows, seq]; seqlens_k [rows] = each row's total length - 1 (GQA convention);
        total_len = the batch maximum of total lengths; logits_index [n] flat indices into
        rows*seq. KV rows [start, start+rows) are updated in place. Returns, per `head`: "logits" float32
        [n, vocab]; "next_token" int64 [n] (the graph's ArgMax); "topk" (values float32 [n, K], ids int64
        [n, K]), the graph's TopK, sorted largest first. The last two need the engine's sampling head.
        `features` [m] (an engine with an EAGLE head, passed only then): flat indices as logits_index whose last
        hidden state the call returns too, as (the above, float32 [m, hidden])."""
        raise NotImplementedError

    def bucket(self, rows: int) -> int | None:
        """The smallest graph bucket holding `rows` decode rows from slot 0, or None (eager)."""
        return next((b for b in self.graph_buckets if b >= rows), None)

    def padded(self, past_len: int, n: int) -> int:
        """The length a call of `n` new tokens on a row holding `past_len` runs at: with prompt buckets the
        smallest bucket >= n that the row has room for (a call shape's first run is slow on CUDA: a few shapes
        serve every prompt), else n. A single token (decode) is never padded."""
        if n < 2:
            return n
        return next((b for b in self.prompt_buckets if b >= n and past_len + b <= self.spec.max_seq_len), n)

    def warm_prompt_shapes(self, longest: int) -> int:
        """Run each prompt bucket up to `longest` tokens once on row 0 (its KV is rewritten by whatever the row
        holds next), so no request pays a shape's first run; returns the shapes run."""
        if not self.prompt_buckets:
            return 0
        head = "next_token" if self.has_next_token else "logits"
        lengths = [b for b in self.prompt_buckets if b <= max(longest, self.prompt_buckets[0])]
        for b in lengths:
            self.extend(0, 0, [0] * b, head=head)
        return len(lengths)

    def prefill(self, start: int, prompts: list[list[int]]) -> np.ndarray:
        """First prompt of rows start.. (positions from 0); returns each row's last logits [rows, vocab]."""
        lens = np.array([len(p) for p in prompts])
        seq = self.padded(0, int(lens.max()))  # the padding past a row's length is a shorter row's
        ids = np.zeros((len(prompts), seq), dtype=np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
        last = np.arange(len(prompts)) * seq + lens - 1
        return self.run(start, ids, lens - 1, seq, last)

    def extend(self, slot: int, past_len: int, tokens: list[int], all_logits: bool = False,
               head: str = "logits", features: bool = False) -> np.ndarray:
        """Append `tokens` to one row that already holds `past_len` tokens (chunked prefill, verify).
        Returns logits for every new token [n, vocab] or only the last [1, vocab] (`head` "next_token": the
        ArgMax ids instead, [n] or [1]; "hidden": (logits, the last hidden state [n, hidden]), an engine built for
        an EAGLE head). `features` (an EAGLE engine): (that, the last hidden state at every new token [n, hidden])."""
        n = len(tokens)
        seq = self.padded(past_len, n)  # padding runs as tokens after the chunk: causal, never attended to, and
        total = past_len + seq          # its KV is overwritten by the row's next tokens before anything reads it
        index = np.arange(n) if all_logits else np.array([n - 1])
        ids = np.zeros((1, seq), np.int64)
        ids[0, :n] = tokens
        every = np.arange(n) if features else None
        return self.run(slot, ids, np.array([total - 1]), total, index, head, **_features(every))

    def decode(self, start: int, tokens: np.ndarray, past_lens: np.ndarray, head: str = "logits",
               features: np.ndarray | None = None):
        """One new token per row for rows start..; past_lens [rows]; returns logits [rows, vocab] (or the
        sampling head's outputs, see `run`). `features` (an EAGLE engine): the rows whose last hidden state the call
        returns too, as (that, [len(features), hidden])."""
        rows = len(tokens)
        return self.run(start, np.asarray(tokens).reshape(rows, 1), past_lens,
                        int(past_lens.max()) + 1, np.arange(rows), head, **_features(features))


def _features(positions: np.ndarray | None) -> dict:
    """`run`'s features argument, passed only when asked for (a runner without an EAGLE output has none)."""
    return {} if positions is None else {"features": positions}
