"""EAGLE draft heads at run time: the head's engine (`EagleRunner`, built by builder/eagle_head.py into
`<engine>/draft`, with its own one-layer KV cache whose slots mirror the target's) and the chain it drafts
(`draft_chain`), fed by the target's last hidden state (the engine output `hidden_states`, at positions of its own).

A sequence's head KV holds, at position t, the pair (f_t, x_{t+1}): the target's feature at t and the token after
it. Every call on an EAGLE row returns the target's features at the positions it computed (a prompt chunk's every
position, a plain decode step's token, a verify's accepted tokens: `feeds_head`), and the row's SpecState keeps them
(`Features`) until the head reads them at its next draft, so the head drafts right after the prompt and after plain
steps without a target call of its own. Only positions whose features no call returned (a reused prefix: its KV was
copied, not computed) are caught up by running the target over them again on the sequence's own row, with no logits
but the last: the cost the pay-or-fall-back policy counts as a re-run (runtime/speculation/draft_policy.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError, Manifest
from runtime.manifest.types import Rope, from_json
from runtime.model.kv_cache import KVCache
from runtime.model.ort_session import session_options
from runtime.model.rotary import rope_tables

HEAD_MANIFEST = "eagle.json"  # written by builder/eagle_head.py into the head's engine folder
DRAFT_IDS = "draft_ids.npy"
KIND = "eagle"


def is_head(path: Path) -> bool:
    """Whether the engine folder `path` is an EAGLE head (not a draft model)."""
    return (Path(path) / HEAD_MANIFEST).is_file()


def head_mismatch(record: dict, target: Manifest, tokenizer_sha256: str) -> str | None:
    """Why a head trained for `record`'s target cannot draft for `target`, or None: hidden size, layer count,
    vocabulary and tokenizer are recorded at training and must be the target's (engine-build and load check it)."""
    hp = target.model.hyperparameters
    for key, ours in (("hidden_size", hp["hidden_size"]), ("num_layers", hp["num_layers"]),
                      ("vocab_size", hp["vocab_size"]), ("tokenizer_sha256", tokenizer_sha256)):
        if record.get(key) != ours:
            return (f"this EAGLE head was trained for another target: its {key} is {record.get(key)!r}, the "
                    f"target's {ours!r}; train a head for this target (engine-compress TARGET --eagle)")
    return None


def tokenizer_sha256(engine_dir: Path) -> str:
    """The engine's tokenizer identity as the head records it (builder/compress/eagle.py tokenizer_hash)."""
    import hashlib

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(Path(engine_dir) / "tokenizer.json")).get_vocab(with_added_tokens=True)
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


class EagleRunner:
    """The head's session and KV cache ([slots, kv_heads, max_seq_len, head_dim], one layer: the target's slot
    count and length). `run` appends tokens with their features to one row and returns the head's draft logits
    [n, K] and predicted features [n, hidden] at every new position."""

    kind = KIND

    def __init__(self, path: Path, target: Manifest, target_dir: Path, spec: KVCacheSpec, threads: int | None = None,
                 device: str = "cpu"):
        self.path = self.engine_dir = Path(path)
        head = json.loads((self.path / HEAD_MANIFEST).read_text())
        if problem := head_mismatch(head, target, tokenizer_sha256(target_dir)):
            raise EngineError(f"EAGLE head {path}: {problem}")
        if device != "cpu":
            raise EngineError(f"EAGLE head {path}: runs on CPU only for now (its KV cache is host memory); load the "
                              f"engine on cpu, or without the head")
        built = from_json(KVCacheSpec, head["kv_cache"], "eagle.kv_cache")
        self.spec = built.resized(spec.slots, spec.max_seq_len)
        self.cache = KVCache(self.spec, "cpu")
        self.draft_ids = np.load(self.path / DRAFT_IDS)
        self.hidden_size = int(head["hidden_size"])
        self.session = ort.InferenceSession(str(self.path / "model.onnx"), session_options(threads, False),
                                            providers=["CPUExecutionProvider"])
        cos, sin = rope_tables(from_json(Rope, head["rope"], "eagle.rope"), self.spec.max_seq_len, "float32")
        self.tables = {"cos_cache": ort.OrtValue.ortvalue_from_numpy(cos),
                       "sin_cache": ort.OrtValue.ortvalue_from_numpy(sin)}
        self.new_call_shapes = 0  # every call binds afresh: no shape is slower the first time than later

    def run(self, slot: int, past_len: int, tokens: list[int], features: np.ndarray,
            last_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Append `tokens` (x_{t+1}) with `features` [n, hidden] (f_t) to row `slot` holding `past_len` pairs;
        returns (draft logits [n, K], predicted features [n, hidden]) at the n new positions (`last_only`: at the
        last one, [1, K] and [1, hidden]: a catch-up drafts from there only)."""
        n = len(tokens)
        total = past_len + n
        index = np.array([n - 1] if last_only else np.arange(n), np.int64)
        inputs = {"input_ids": np.asarray(tokens, np.int64).reshape(1, n),
                  "hidden_in": np.ascontiguousarray(features, np.float32).reshape(1, n, self.hidden_size),
                  "logits_index": index, "seqlens_k": np.array([total - 1], np.int32),
                  "total_sequence_length": np.array(total, np.int32)}
        logits = np.empty((len(index), len(self.draft_ids)), np.float32)
        hidden = np.empty((len(index), self.hidden_size), np.float32)
        binding = self.session.io_binding()
        for name, array in inputs.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        for name, value in self.tables.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        binding.bind_ortvalue_output("hidden_states", ort.OrtValue.ortvalue_from_numpy(hidden))
        self.cache.bind(binding, slot, slot + 1)
        self.session.run_with_iobinding(binding)
        return logits, hidden

    def warm_prompt_shapes(self, longest: int) -> int:
        """Runner's interface: the head runs no padded prompt shapes."""
        return 0

    def close(self) -> None:
        """Nothing to stop (Runner's interface)."""


@dataclass
class Features:
    """The target's features at positions [start, end) of a sequence that its head has not read yet, as the calls
    on its row returned them (prompt chunks, plain decode steps, verifies): kept in its SpecState."""

    start: int
    end: int
    parts: list[np.ndarray] = field(default_factory=list)

    def between(self, lo: int, hi: int) -> np.ndarray:
        """The features at positions [lo, hi), all held: [hi - lo, hidden]."""
        return np.concatenate(self.parts)[lo - self.start:hi - self.start]


def feeds_head(runner, seq) -> bool:
    """Whether `seq`'s calls return the target's features: it speculates with the engine's EAGLE head (not on a LoRA
    adapter: those rows decode plainly, see Speculator.should_draft). Other rows fetch nothing."""
    spec = seq.speculation
    return spec is not None and spec.config.method == KIND and seq.params.adapter is None and runner.has_hidden


def keep_features(state, position: int, hidden: np.ndarray) -> None:
    """A call on the sequence's row returned the target's features at positions [position, position + n): kept
    after those held when they follow them (or overlap their end: recomputed after a preemption), else instead of
    them (a gap, such as a reused prefix, the next draft catches up)."""
    held = state.features
    if held is not None and held.start <= position <= held.end:
        if position < held.end:
            held.parts, held.end = [held.between(held.start, position)], position
        held.parts.append(hidden)
        held.end += len(hidden)
    else:
        state.features = Features(position, position + len(hidden), [hidden])


def behind(seq) -> tuple[int, int]:
    """What the head must catch up on before it drafts for `seq`: the pairs it has not read, and among their positions
    those whose features no call returned (the target runs again over them, on the sequence's own row)."""
    state, last = seq.speculation, len(seq.all_ids) - 1
    start, held = state.draft_cached, state.features
    if held is None or held.end <= start or held.start >= last:
        return last - start, last - start
    return last - start, max(0, held.start - start) + max(0, last - held.end)


def _features_for(target, seq, start: int, last: int) -> tuple[np.ndarray, int]:
    """The target's features at positions [start, last): those held, the others from running the target again over
    them (no logits but the last); returns them and how many positions the target ran."""
    held, ids = seq.speculation.features, seq.all_ids
    if held is None or held.end <= start or held.start >= last:
        held = Features(last, last)
    lo, hi = max(start, held.start), min(last, held.end)
    parts, rerun = [], 0
    for a, b in ((start, lo), (lo, hi), (hi, last)):
        if b <= a:
            continue
        if a >= held.start and b <= held.end:
            parts.append(held.between(a, b))
        else:
            parts.append(target.extend(seq.slot, a, ids[a:b], features=True)[1])
            rerun += b - a
    return (np.concatenate(parts) if parts else np.zeros((0, target.hidden_size), np.float32)), rerun


def draft_chain(target, head: EagleRunner, seq, k: int, costs, timed) -> tuple[list[int], list[np.ndarray] | None]:
    """k draft tokens for `seq` from the head, chained: catch the head up on the pairs it has not read (the features
    the target's calls returned for its row; where none did, after a reused prefix, the target runs again over those
    positions: timed per token as a re-run), then k - 1 one-token steps fed the head's own features. Returns the
    drafts and, for a row that samples, each draft's distribution over the whole vocabulary (zero outside the
    head's draft vocabulary)."""
    from runtime.request.sampler import draw, probs_after_warping

    state, ids = seq.speculation, seq.all_ids
    last = len(ids) - 1  # the newest token's position: the target has not read it yet
    start = state.draft_cached
    with timed(target) as refeed:
        features, rerun = _features_for(target, seq, start, last)
    if rerun > 2 and refeed.warm:
        costs.observe_refeed(rerun, refeed.seconds)
    with timed(head) as catch_up:
        logits, hidden = head.run(seq.slot, start, ids[start + 1:last + 1], features, last_only=True)
    state.draft_cached, state.features = last, None
    if last - start > 2:
        costs.observe_draft_prefill(last - start, catch_up.seconds)
    greedy = seq.params.greedy and seq.params.repetition_penalty == 1.0
    drafts, probs = [], []
    with timed(head) as steps:
        while True:
            if greedy:
                token = int(head.draft_ids[int(np.argmax(logits[-1]))])
            else:
                full = np.full(target.vocab_size, -np.inf, np.float32)
                full[head.draft_ids] = logits[-1]
                q = probs_after_warping(full, seq.params, np.asarray(ids + drafts, dtype=np.int64))
                token = int(np.argmax(q)) if seq.params.greedy else draw(q, seq.rng)
                probs.append(q)
            drafts.append(token)
            if len(drafts) == k:
                break
            logits, hidden = head.run(seq.slot, last + len(drafts) - 1, [token], hidden[-1:])
    if k > 1:
        costs.observe_draft_step(steps.seconds / (k - 1))
    return drafts, None if greedy else probs


def keep_verified(seq, hidden: np.ndarray, accepted: int) -> None:
    """After a verify: the target's features at the last token and the accepted drafts (hidden [k + 1, hidden]
    from the verify call) are the pairs the head reads at its next draft."""
    state = seq.speculation
    keep_features(state, len(seq.all_ids) - 1, hidden[:accepted + 1].copy())
