"""EAGLE draft heads at run time: the head's engine (`EagleRunner`, built by builder/eagle_head.py into
`<engine>/draft`, with its own one-layer KV cache whose slots mirror the target's) and the chain it drafts
(`EagleDrafter`), fed by the target's last hidden state (the engine output `hidden_states`).

A sequence's head KV holds, at position t, the pair (f_t, x_{t+1}): the target's feature at t and the token after
it. A verify returns the target's features at the positions it checked; those of the accepted tokens are the pairs
the head reads first at its next draft (`SpecState.features`), so after a verify the head is caught up without a
target call of its own. Positions whose features no call returned (the prompt, tokens decoded plainly while
drafting did not pay) are caught up by running the target over them again on the sequence's own row (`catch_up`):
the cost the pay-or-fall-back policy counts as a draft catch-up (runtime/speculation/draft_policy.py)."""
from __future__ import annotations

import json
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
    for field, ours in (("hidden_size", hp["hidden_size"]), ("num_layers", hp["num_layers"]),
                        ("vocab_size", hp["vocab_size"]), ("tokenizer_sha256", tokenizer_sha256)):
        if record.get(field) != ours:
            return (f"this EAGLE head was trained for another target: its {field} is {record.get(field)!r}, the "
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

    def run(self, slot: int, past_len: int, tokens: list[int], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append `tokens` (x_{t+1}) with `features` [n, hidden] (f_t) to row `slot` holding `past_len` pairs;
        returns (draft logits [n, K], predicted features [n, hidden]) at the n new positions."""
        n = len(tokens)
        total = past_len + n
        inputs = {"input_ids": np.asarray(tokens, np.int64).reshape(1, n),
                  "hidden_in": np.ascontiguousarray(features, np.float32).reshape(1, n, self.hidden_size),
                  "logits_index": np.arange(n, dtype=np.int64), "seqlens_k": np.array([total - 1], np.int32),
                  "total_sequence_length": np.array(total, np.int32)}
        logits = np.empty((n, len(self.draft_ids)), np.float32)
        hidden = np.empty((n, self.hidden_size), np.float32)
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


def draft_chain(target, head: EagleRunner, seq, k: int, costs, timed) -> tuple[list[int], list[np.ndarray] | None]:
    """k draft tokens for `seq` from the head, chained: catch the head up on the pairs it has not read (the
    features the last verify returned, else the target run again over the positions no call returned features
    for: timed as a draft catch-up per token), then k - 1 one-token steps fed the head's own features. Returns the
    drafts and, for a row that samples, each draft's distribution over the whole vocabulary (zero outside the
    head's draft vocabulary)."""
    from runtime.request.sampler import draw, probs_after_warping

    state, ids = seq.speculation, seq.all_ids
    last = len(ids) - 1  # the newest token's position: the target has not read it yet
    start, features = state.features if state.features is not None else (state.draft_cached, None)
    if start != state.draft_cached or features is None:  # preempted, or no verify returned them: none pending
        start, features = state.draft_cached, np.zeros((0, head.hidden_size), np.float32)
    known = start + len(features)
    with timed(target) as catch_up:
        if known < last:  # features the target never returned: run it over those positions again, on its own row
            _, more = target.extend(seq.slot, known, ids[known:last], all_logits=True, head="hidden")
            features = np.concatenate([features, more])
        logits, hidden = head.run(seq.slot, start, ids[start + 1:last + 1], features[:last - start])
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


def keep_features(seq, hidden: np.ndarray, accepted: int) -> None:
    """After a verify: the target's features at the last token and the accepted drafts (hidden [k + 1, hidden]
    from the verify call) are the pairs the head reads at its next draft."""
    state = seq.speculation
    state.features = (state.draft_cached, hidden[:accepted + 1].copy())
