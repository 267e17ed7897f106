"""EAGLE-style draft heads (Li et al. 2024, EAGLE-1/3): a head that drafts from the target's own features.

At position t the head reads the target's last hidden state f_t (after the final norm: what the target's lm_head
reads) and the embedding of the next token x_{t+1}, and predicts f_{t+1}:

    f^_{t+1} = final_norm(layer(fc([embed(x_{t+1}), f_t])))          # [batch, seq, hidden]
    draft logits over x_{t+2} = lm_head_K(f^_{t+1})                   # [batch, seq, K]

`layer` is one decoder layer of the target's family (initialised from the target's last layer), `final_norm` a copy
of the target's, `lm_head_K` the target's lm_head rows of the K tokens its own generations use most (EAGLE-3 / FR-Spec's
reduced draft vocabulary: K chosen by measured coverage, `draft_ids` maps a draft index to a token id). A chain
drafts by feeding f^ back in place of f. The loss is next-feature regression (smooth L1) plus KL from the target's
next-token distribution (over the K ids) to the head's; `train_chain` > 1 adds EAGLE-3's training-time test, passes
fed the head's own features of the pass before, as the later steps of a chain are.

Saved as a folder the recipe names (`speculative: {draft_model: DIR}`): HEAD_FILE (what it was trained for: the
target's hidden size, layer count, vocabulary, tokenizer hash; the draft vocabulary; the training report) and
WEIGHTS_FILE. builder/eagle_head.py builds it into the engine; runtime/speculation/eagle.py runs it. A saved head
can be trained further (`--init-head DIR`, SavedHead): its weights and draft vocabulary are the start, and the new
record keeps the earlier runs' reports."""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from builder.compress.data import batches
from builder.compress.distill import DistillConfig, Trainer, atomic_save
from builder.compress.plan import CompressError

HEAD_FILE = "eagle.json"
WEIGHTS_FILE = "eagle.safetensors"
FEATURES_FILE = "target_features.pt"
KIND = "eagle"


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """The head's own settings (training schedule: DistillConfig). `coverage`: K is the smallest multiple of 64
    whose most frequent tokens cover this share of the training tokens (the draft can only propose those);
    `hidden_weight`/`kl_weight`: the two losses' weights; `train_chain`: the chain positions trained (1: the
    target's features only; 2, 3: plus passes fed the head's own features, the training-time test);
    `train_lm_head`: whether the draft lm_head (the target's rows of the K ids at the start) is trained."""

    coverage: float = 0.97
    hidden_weight: float = 1.0
    kl_weight: float = 1.0
    train_chain: int = 2
    train_lm_head: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.coverage <= 1:
            raise CompressError(f"--eagle-coverage is a share of tokens in (0, 1], got {self.coverage}")
        if self.train_chain not in (1, 2, 3):
            raise CompressError(f"--eagle-train-chain is 1, 2 or 3 chain positions, got {self.train_chain}")
        if self.hidden_weight < 0 or self.kl_weight < 0 or self.hidden_weight + self.kl_weight == 0:
            raise CompressError("--eagle-hidden-weight and --eagle-kl-weight are >= 0 and not both 0")


TRAINED_FOR = ("hidden_size", "num_layers", "vocab_size", "tokenizer_sha256")  # a head's target; engine-build checks
# the same (runtime/speculation/eagle.py head_mismatch)
RUN_KEYS = ("target", "coverage_training", "coverage_heldout", "heldout", "distill", "eagle", "history")  # a run's


def target_identity(config, tokenizer) -> dict:
    """What a head records of its target (TRAINED_FOR), from the target's config and tokenizer."""
    return {"hidden_size": config.hidden_size, "num_layers": config.num_hidden_layers,
            "vocab_size": config.vocab_size, "tokenizer_sha256": tokenizer_hash(tokenizer.get_vocab())}


def tokenizer_hash(vocab: dict[str, int]) -> str:
    """sha256 of a tokenizer's token -> id map (added tokens included): the head's tokenizer identity, the same
    whether read by transformers (training) or tokenizers (the engine's tokenizer.json at load)."""
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


def draft_vocabulary(rows: torch.Tensor, vocab_size: int, coverage: float, always: tuple[int, ...] = ()) \
        -> tuple[torch.Tensor, float]:
    """The draft vocabulary: the most frequent tokens of `rows` (their next-token targets), fewest (a multiple
    of 64) covering `coverage` of them, plus `always` (end-of-text ids); sorted ids [K] and the coverage reached."""
    counts = torch.bincount(rows[:, 1:].reshape(-1), minlength=vocab_size).double()
    for token in always:
        counts[token] = counts.max() + 1
    order = torch.argsort(counts, descending=True, stable=True)
    cumulative = torch.cumsum(counts[order], 0) / counts.sum()
    k = int(torch.searchsorted(cumulative, torch.tensor(coverage, dtype=torch.float64))) + 1
    k = min(vocab_size, 64 * math.ceil(k / 64))
    return torch.sort(order[:k]).values, float(cumulative[k - 1])


class EagleHead(torch.nn.Module):
    """The head (module docstring); `target` a transformers Llama-family causal LM (read, never changed)."""

    def __init__(self, target, draft_ids: torch.Tensor, train_lm_head: bool = True):
        super().__init__()
        config = copy.deepcopy(target.config)
        config._attn_implementation = "sdpa"  # attention_mask None: causal
        hidden = config.hidden_size
        self.embed = torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().clone())
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
        with torch.no_grad():  # start as "the embedding plus the feature", the last layer's own input shape
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            self.fc.weight[:, hidden:].copy_(torch.eye(hidden))
            self.fc.bias.zero_()
        last = len(target.model.layers) - 1
        self.layer = copy.deepcopy(target.model.layers[last])
        self.layer.self_attn.config = config
        self.layer.self_attn.layer_idx = 0
        self.norm = copy.deepcopy(target.model.norm)
        self.rotary = copy.deepcopy(target.model.rotary_emb)
        self.register_buffer("draft_ids", draft_ids.clone(), persistent=False)
        self.lm_head = torch.nn.Linear(hidden, len(draft_ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])
        self.lm_head.weight.requires_grad_(train_lm_head)

    def forward(self, ids: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [b, s] (x_{t+1}), features [b, s, hidden] (f_t) -> (f^_{t+1} [b, s, hidden], logits [b, s, K])."""
        x = self.fc(torch.cat([self.embed(ids), features], dim=-1))
        positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        out = self.layer(x, attention_mask=None, position_ids=positions,
                         position_embeddings=self.rotary(x, positions))
        f = self.norm(out[0] if isinstance(out, tuple) else out)
        return f, self.lm_head(f)


@torch.no_grad()
def target_features(target, rows: torch.Tensor, path: Path, device: str = "cpu", batch_size: int = 8,
                    save_every: int = 8) -> torch.Tensor:
    """The target's final-norm hidden states over `rows` [n, seq + 1] -> [n, seq + 1, hidden] (float16 on disk,
    computed once per run and reused by a resume on the same rows; saved every `save_every` batches on the way, so
    an interrupted pass resumes after its last save)."""
    key = hashlib.sha256(rows.numpy().tobytes()).hexdigest()
    saved = torch.load(path, weights_only=True) if path.is_file() else {"key": None}
    out = saved["parts"] if saved["key"] == key else []
    if saved["key"] == key and sum(len(part) for part in out) == rows.shape[0]:
        return torch.cat(out).float()
    from tqdm import tqdm

    path.parent.mkdir(parents=True, exist_ok=True)
    todo = list(batches(rows, batch_size))[len(out):]  # every part but a last short one holds batch_size rows
    for n, batch in enumerate(tqdm(todo, desc="target features", unit="batch", dynamic_ncols=True), 1):
        out.append(target.model(input_ids=batch.to(device), use_cache=False).last_hidden_state.half().cpu())
        if n % save_every == 0 or n == len(todo):
            atomic_save({"key": key, "parts": out}, path)
    return torch.cat(out).float()


def head_loss(head: EagleHead, target_head: torch.Tensor, ids: torch.Tensor, features: torch.Tensor,
              cfg: EagleConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, accepted share) on windows ids [b, s + 1], features [b, s + 1, hidden]: position t reads (f_t, x_{t+1})
    and is scored against f_{t+1} and the target's distribution over the K draft ids, softmax(f_{t+1} @ W_K^T).
    The accepted share is how often the head's argmax is the target's argmax over all tokens (a greedy draft's
    first-token acceptance)."""
    nxt, truth = ids[:, 1:], features[:, 1:]
    with torch.no_grad():
        target_logp = F.log_softmax(truth @ target_head.T, dim=-1)  # [b, s, K] over the draft ids
    passes = [features[:, :-1]]
    loss, first = 0.0, None
    for step in range(cfg.train_chain):
        predicted, logits = head(nxt, passes[-1])
        if first is None:
            first = logits
        loss = loss + cfg.hidden_weight * F.smooth_l1_loss(predicted, truth) + cfg.kl_weight * F.kl_div(
            F.log_softmax(logits, dim=-1), target_logp, log_target=True, reduction="none").sum(-1).mean()
        passes.append(torch.cat([features[:, :1], predicted[:, :-1]], dim=1))  # f_0, then the head's f^_t
    return loss, first.detach()


class EagleTrainer(Trainer):
    """Trainer (resume, time budget, Ctrl-C) over the head: `rows` are token windows, and `topk` in Trainer.run is
    the tuple (features, heldout_ids, heldout_features, full_head) this subclass reads."""

    def __init__(self, head: EagleHead, cfg: DistillConfig, eagle: EagleConfig, state_dir: Path,
                 full_head: torch.Tensor, device: str = "cpu"):
        super().__init__(head, torch.nn.Identity(), cfg, state_dir, device)
        self.eagle, self.full_head = eagle, full_head.to(device)
        self.heldout_features: torch.Tensor | None = None
        self.heldout_replies: torch.Tensor | None = None  # evaluate_head's `replies`

    def _loss(self, rows: torch.Tensor, idx: torch.Tensor, features) -> torch.Tensor:
        ids, feats = rows[idx].to(self.device), features[idx].to(self.device)
        return head_loss(self.student, self.student_target_head(), ids, feats, self.eagle)[0]

    def student_target_head(self) -> torch.Tensor:
        return self.full_head[self.student.draft_ids]

    def _record(self, rows_heldout: torch.Tensor, train_loss: float | None) -> None:
        entry = {"step": self.step, "tokens": self.tokens, "train_loss": train_loss} | self._elapsed()
        entry |= evaluate_head(self.student, self.full_head, rows_heldout, self.heldout_features, self.device,
                               replies=self.heldout_replies)
        self.history.append(entry)


CHAIN = 3  # draft positions evaluated: issue 49's speed is measured with chains of 3


@torch.no_grad()
def evaluate_head(head: EagleHead, full_head: torch.Tensor, ids: torch.Tensor, features: torch.Tensor,
                  device: str = "cpu", batch_size: int = 8, replies: torch.Tensor | None = None) -> dict:
    """Held-out figures, as greedy speculation scores a chain of CHAIN drafts: `accept_1`, how often the head's
    first draft token is the target's argmax over the whole vocabulary (f_{t+1} @ W^T); `accept_n` (n > 1), the
    same for the n-th token of a chain (the head fed its own features n - 1 times) given that the n - 1 before it
    were right; `accepted_length_3`, the tokens a verify of a chain of 3 yields on average, 1 + a1 + a1 a2 +
    a1 a2 a3; the held-out loss in `heldout_kl` (the name Trainer's progress line prints).

    `replies` [rows, seq + 1] bool (data.window_replies: the assistant replies' tokens): only the drafts the engine
    makes are scored, those whose chain starts at a reply token and predicts one (`scored`: "replies"); the chat
    template's and the prompts' tokens, which the engine never drafts and a head predicts far better, are not.
    Without it every position counts (`scored`: "all")."""
    was = head.training
    head.eval()
    hits, tried = [0] * CHAIN, [0] * CHAIN
    kl = 0.0
    for lo in range(0, ids.shape[0], batch_size):
        x, f = ids[lo:lo + batch_size].to(device), features[lo:lo + batch_size].to(device)
        truth = (f[:, 1:] @ full_head.T).argmax(-1)  # [b, s] the target's next-next tokens
        kl += head_loss(head, full_head[head.draft_ids], x, f, EagleConfig(train_chain=1))[0].item() * x.shape[0]
        fed, chain_ok = f[:, :-1], torch.ones_like(truth, dtype=torch.bool)  # chain_ok: steps before all right
        reply = torch.ones_like(x, dtype=torch.bool) if replies is None else replies[lo:lo + batch_size].to(device)
        reply = torch.cat([reply, reply[:, -1:]], dim=1)  # [b, s + 2]: the last draft's token is past the window
        for n in range(CHAIN):
            predicted, logits = head(x[:, 1:], fed)
            ok = head.draft_ids[logits.argmax(-1)] == truth
            # step n at t drafts token t + 2 from a chain whose newest token (the engine's last) is at t + 1 - n
            root = torch.cat([torch.zeros_like(reply[:, :n]), reply[:, 1:reply.shape[1] - 1 - n]], dim=1)  # [b, s]
            scored = chain_ok & reply[:, 2:] & root
            hits[n], tried[n] = hits[n] + int((ok & scored).sum()), tried[n] + int(scored.sum())
            # step n + 1 at t follows step n at t - 1 (fed its feature): it counts where that one was right
            chain_ok = torch.cat([torch.zeros_like(ok[:, :1]), (ok & chain_ok)[:, :-1]], dim=1)
            fed = torch.cat([f[:, :1], predicted[:, :-1]], dim=1)
    head.train(was)
    rates = [h / max(t, 1) for h, t in zip(hits, tried)]
    length = sum(math.prod(rates[:n]) for n in range(CHAIN + 1))
    return {f"accept_{n + 1}": rate for n, rate in enumerate(rates)} | {
        "accepted_length_3": length, "heldout_kl": kl / ids.shape[0], "heldout_ppl": math.nan,
        "scored": "all" if replies is None else "replies", "drafts_scored": tried[0]}


def save_head(head: EagleHead, out: Path, record: dict) -> Path:
    """HEAD_FILE (`record` plus the draft vocabulary) and WEIGHTS_FILE into `out`, each written whole then renamed."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.detach().cpu().contiguous() for name, tensor in head.state_dict().items()}
    weights["draft_ids"] = head.draft_ids.cpu().to(torch.int64)
    save_file(weights, str(out / (WEIGHTS_FILE + ".tmp")))
    (out / (WEIGHTS_FILE + ".tmp")).replace(out / WEIGHTS_FILE)
    (out / (HEAD_FILE + ".tmp")).write_text(json.dumps(record | {"kind": KIND, "draft_vocab": len(head.draft_ids)},
                                                        indent=1) + "\n")
    (out / (HEAD_FILE + ".tmp")).replace(out / HEAD_FILE)
    return out


@dataclasses.dataclass(frozen=True)
class SavedHead:
    """A head folder an earlier run wrote (`--init-head`): its record, its weights (EagleHead's state dict) and its
    draft vocabulary [K], which a run that starts from it keeps (the lm_head's rows are those ids')."""

    path: Path
    record: dict
    weights: dict[str, torch.Tensor]
    draft_ids: torch.Tensor

    @property
    def steps(self) -> int:
        """The training steps behind these weights, earlier continuations included."""
        history = self.record.get("history") or [{"step": 0}]
        return self.record.get("steps_total", history[-1]["step"])

    def load_into(self, head: EagleHead) -> None:
        try:
            head.load_state_dict(self.weights)
        except RuntimeError as err:
            raise CompressError(f"--init-head {self.path}: its weights do not fit a head for this target ({err})") \
                from None

    def provenance(self) -> dict:
        """What the continued head's record says of where it started: the folder, the steps before, and every
        earlier run's report (oldest first)."""
        run = {"head": str(self.path)} | {k: self.record[k] for k in RUN_KEYS if k in self.record}
        return {"continued_from": str(self.path), "steps_before": self.steps,
                "earlier_runs": self.record.get("earlier_runs", []) + [run]}


def read_head(path: str | Path, target: dict) -> SavedHead:
    """The head folder `path` (`--init-head`), checked against `target` (target_identity) before any work: a
    CompressError names what differs and what is allowed."""
    path = Path(path)
    record = read_record(path)
    if record is None or record.get("kind") != KIND or not (path / WEIGHTS_FILE).is_file():
        raise CompressError(f"--init-head {path}: not an EAGLE head folder; give a folder engine-compress --eagle "
                            f"wrote ({HEAD_FILE} and {WEIGHTS_FILE})")
    for key in TRAINED_FOR:
        if record.get(key) != target[key]:
            raise CompressError(f"--init-head {path}: the head was trained for another target: its {key} is "
                                f"{record.get(key)!r}, this target's {target[key]!r}; --init-head takes a head "
                                f"trained for this target (the same hidden size, layers, vocabulary and tokenizer)")
    from safetensors.torch import load_file

    weights = load_file(str(path / WEIGHTS_FILE))
    ids = weights.pop("draft_ids")
    within = len(ids) > 0 and 0 <= int(ids[0]) and int(ids[-1]) < target["vocab_size"]
    if len(ids) != record.get("draft_vocab") or not torch.equal(ids, ids.unique()) or not within:
        raise CompressError(f"--init-head {path}: its draft vocabulary ({len(ids)} ids) is not the "
                            f"{record.get('draft_vocab')} sorted token ids below {target['vocab_size']} its "
                            f"{HEAD_FILE} records; the folder is damaged")
    return SavedHead(path, record, weights, ids)


def read_record(path: str | Path) -> dict | None:
    """The head's HEAD_FILE record when `path` is an EAGLE head folder, else None."""
    file = Path(path) / HEAD_FILE
    return json.loads(file.read_text()) if file.is_file() else None
