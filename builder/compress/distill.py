"""Knowledge distillation of a student on a teacher's next-token distribution: forward KL at a temperature
(optionally + cross-entropy on the text, optionally against the teacher's top-k logits cached once on disk), AdamW
with linear warmup and cosine decay, held-out perplexity every few steps, and a resumable state written atomically
every few steps and on Ctrl-C (the step in flight finishes first, so the state is always a whole step)."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from builder.compress.data import batches
from builder.compress.plan import CompressError

STATE_FILE = "train_state.pt"
TOPK_FILE = "teacher_topk.pt"


@dataclass(frozen=True)
class DistillConfig:
    """Training settings. kd_weight * T^2 * KL(teacher_T || student_T) + ce_weight * CE(text); top_k > 0
    distills against the teacher's top-k logits only (renormalised), computed once and cached. max_minutes > 0
    ends training at the first step past that much training time (wall clock, evaluations included) as if
    `steps` were reached: a time budget, where the schedule is still sized to `steps`."""

    steps: int = 200
    batch_size: int = 8
    lr: float = 1e-3
    warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0
    kd_weight: float = 1.0
    ce_weight: float = 0.0
    top_k: int = 0
    eval_every: int = 50
    save_every: int = 50
    seed: int = 0
    max_minutes: float = 0.0

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.top_k < 0 or self.eval_every < 1 or self.save_every < 1:
            raise CompressError("distill: steps >= 0, batch_size >= 1, top_k >= 0, eval_every >= 1, save_every >= 1")
        if self.max_minutes < 0:
            raise CompressError(f"distill: max_minutes is >= 0 (0: no time limit), got {self.max_minutes}")
        if self.temperature <= 0:
            raise CompressError(f"distill: temperature must be > 0, got {self.temperature}")
        if self.kd_weight < 0 or self.ce_weight < 0 or self.kd_weight + self.ce_weight == 0:
            raise CompressError("distill: kd_weight and ce_weight are >= 0 and not both 0")


class Interrupted(Exception):
    """Ctrl-C stopped training after a whole step; the resumable state is at `path`."""

    def __init__(self, step: int, path: Path):
        super().__init__(f"interrupted after step {step}; the state is saved in {path}: run the same command "
                         f"again to resume")
        self.step, self.path = step, path


@contextlib.contextmanager
def _stop_flag():
    """A list that gets an entry on Ctrl-C (SIGINT), so the loop stops at the end of the current step."""
    flag: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.append(signum))
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def batch_indices(step: int, rows: int, batch_size: int, seed: int) -> torch.Tensor:
    """The rows of `step`'s batch: epochs over a seeded permutation each, a function of the step alone."""
    positions = torch.arange(step * batch_size, (step + 1) * batch_size)
    epochs = positions // rows
    perms = {int(e): torch.randperm(rows, generator=torch.Generator().manual_seed(seed * 100_003 + int(e)))
             for e in epochs.unique()}
    return torch.stack([perms[int(e)][p % rows] for e, p in zip(epochs, positions)])


def _lr_factor(cfg: DistillConfig):
    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def kd_loss(student_logits: torch.Tensor, teacher: tuple, t: float) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), mean over tokens. `teacher` is (logits, None, None),
    or the cached top-k (values, indices, logsumexp of logits / T): the k tokens plus one bucket for the rest of the
    vocabulary, so the student is not pushed to starve the tokens outside the top k."""
    values, indices, lse = teacher
    logq = F.log_softmax(student_logits.float() / t, dim=-1)
    if indices is None:
        logp = F.log_softmax(values.float() / t, dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1).mean() * t * t
    logp, logq = values.float() / t - lse.float().unsqueeze(-1), logq.gather(-1, indices.long())
    p_rest = (1 - logp.exp().sum(-1)).clamp_min(1e-8)
    q_rest = (1 - logq.exp().sum(-1)).clamp_min(1e-8)
    kl = (logp.exp() * (logp - logq)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    return kl.mean() * t * t


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def teacher_topk(teacher, rows: torch.Tensor, k: int, t: float, cache: Path, device: str, batch_size: int = 8):
    """The teacher's top-k logits of every row, [n, seq, k] (float16 values, int32 indices), and the logsumexp of
    its logits / t, [n, seq] (float32), cached in `cache` under a hash of the rows, k and t (a stale cache is
    recomputed)."""
    key = hashlib.sha256(rows.numpy().tobytes() + f"{k} {t}".encode()).hexdigest()
    if cache.is_file():
        saved = torch.load(cache, weights_only=True)
        if saved["key"] == key:
            return saved["values"], saved["indices"], saved["lse"]
    values, indices, lse = [], [], []
    for batch in tqdm(list(batches(rows, batch_size)), desc="teacher top-k", unit="batch", dynamic_ncols=True):
        logits = teacher(input_ids=batch[:, :-1].to(device), use_cache=False).logits.float()
        top = logits.topk(k, dim=-1)
        values.append(top.values.half().cpu())
        indices.append(top.indices.int().cpu())
        lse.append(torch.logsumexp(logits / t, dim=-1).cpu())
    saved = {"key": key, "values": torch.cat(values), "indices": torch.cat(indices), "lse": torch.cat(lse)}
    atomic_save(saved, cache)
    return saved["values"], saved["indices"], saved["lse"]


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename over it: a reader sees the old or the new file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(student, teacher, rows: torch.Tensor, device: str, batch_size: int = 8) -> dict:
    """Held-out loss / perplexity of the student and its KL (T = 1) to the teacher, mean over tokens."""
    was_training = student.training
    student.eval()
    ce = kl = 0.0
    for batch in batches(rows, batch_size):
        batch = batch.to(device)
        logits = student(input_ids=batch[:, :-1], use_cache=False).logits
        ce += _ce(logits, batch[:, 1:]).item() * batch.shape[0]
        if teacher is not None:
            kl += kd_loss(logits, (teacher(input_ids=batch[:, :-1], use_cache=False).logits, None, None), 1.0).item() \
                * batch.shape[0]
    student.train(was_training)
    ce, kl = ce / rows.shape[0], kl / rows.shape[0]
    return {"heldout_loss": ce, "heldout_ppl": math.exp(ce), "heldout_kl": kl if teacher is not None else None}


class Trainer:
    """One distillation run into `state_dir`: resumes from its state file when one is there."""

    def __init__(self, student, teacher, cfg: DistillConfig, state_dir: Path, device: str = "cpu"):
        self.student, self.teacher, self.cfg, self.device = student.to(device), teacher.to(device).eval(), cfg, device
        self.state_path = Path(state_dir) / STATE_FILE
        decay = [p for p in student.parameters() if p.ndim >= 2]
        rest = [p for p in student.parameters() if p.ndim < 2]
        self.optim = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                        {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, _lr_factor(cfg))
        self.step, self.tokens, self.history = 0, 0, []
        self.clock = {"seconds": 0.0, "cpu_seconds": 0.0}  # training time so far: wall, and this process's CPU
        self.data_key: str | None = None  # sha256 of the training rows: a resume must see the same text
        self.origin: str | None = None  # where the student's weights started if not as made (EAGLE's --init-head)

    def resume(self) -> bool:
        """Load the saved state if there is one (refused when it was made with other settings)."""
        if not self.state_path.is_file():
            return False
        state = torch.load(self.state_path, weights_only=False)
        if state["config"] != dataclasses.asdict(self.cfg):
            changed = sorted(k for k, v in state["config"].items() if dataclasses.asdict(self.cfg).get(k) != v)
            raise CompressError(f"{self.state_path}: a training state made with other settings ({', '.join(changed)}"
                                f" differ); rerun with the same settings to resume, or delete it to start over")
        if state.get("origin") != self.origin:  # its weights replace the start's: the same start only
            raise CompressError(f"{self.state_path}: a training state started from "
                                f"{state.get('origin') or 'new weights'}, this run from {self.origin or 'new weights'}; "
                                f"rerun with the same --init-head to resume, or delete it to start over")
        self.student.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.step, self.tokens, self.history = state["step"], state["tokens"], state["history"]
        self.clock = state.get("clock") or {k: self.history[-1].get(k, 0.0) for k in self.clock}
        self.data_key = state["data"]
        return True

    def save(self) -> None:
        atomic_save({"config": dataclasses.asdict(self.cfg), "model": self.student.state_dict(),
                     "optim": self.optim.state_dict(), "sched": self.sched.state_dict(), "step": self.step,
                     "tokens": self.tokens, "history": self.history, "data": self.data_key,
                     "origin": self.origin, "clock": self._elapsed()}, self.state_path)

    def _loss(self, rows: torch.Tensor, idx: torch.Tensor, topk) -> torch.Tensor:
        batch = rows[idx].to(self.device)
        logits = self.student(input_ids=batch[:, :-1], use_cache=False).logits
        loss = self.cfg.ce_weight * _ce(logits, batch[:, 1:]) if self.cfg.ce_weight else 0.0
        if self.cfg.kd_weight:
            if topk is not None:
                target = tuple(part[idx].to(self.device) for part in topk)
            else:
                with torch.no_grad():
                    target = (self.teacher(input_ids=batch[:, :-1], use_cache=False).logits, None, None)
            loss = loss + self.cfg.kd_weight * kd_loss(logits, target, self.cfg.temperature)
        return loss

    def _start_clock(self) -> None:
        """Training time resumes where the saved state left it (the time between runs does not count)."""
        self._started = (time.perf_counter() - self.clock["seconds"], time.process_time() - self.clock["cpu_seconds"])

    def _elapsed(self) -> dict:
        """Wall seconds and this process's CPU seconds of training so far (held-out evaluations included). The CPU
        time is what the run had of the machine: it excludes waits for a shared CPU and SIGSTOP pauses."""
        wall, cpu = self._started
        return {"seconds": round(time.perf_counter() - wall, 3), "cpu_seconds": round(time.process_time() - cpu, 3)}

    def _record(self, rows_heldout: torch.Tensor, train_loss: float | None) -> None:
        entry = {"step": self.step, "tokens": self.tokens, "train_loss": train_loss} | self._elapsed()
        entry |= evaluate(self.student, self.teacher, rows_heldout, self.device)
        self.history.append(entry)

    def run(self, rows: torch.Tensor, heldout: torch.Tensor, topk=None, on_step=None) -> list[dict]:
        """Train to cfg.steps; returns the history (held-out figures every eval_every steps and at the end).
        `on_step(step)` runs after each step (tests use it to send Ctrl-C). Raises Interrupted on Ctrl-C."""
        cfg, seq = self.cfg, rows.shape[1] - 1
        key = hashlib.sha256(rows.numpy().tobytes()).hexdigest()
        if self.data_key not in (None, key):
            raise CompressError(f"{self.state_path}: the saved training state was made on other text (or another "
                                f"--seq-len / --on-policy); resume with the same text, or delete it to start over")
        self.data_key = key
        self._start_clock()
        if not self.history:
            self._record(heldout, None)
        self.student.train()
        end = cfg.steps
        bar = tqdm(total=cfg.steps, initial=self.step, desc="distill", unit="step", dynamic_ncols=True)
        recent: list[float] = []
        with _stop_flag() as stop, bar:
            while self.step < end:
                tick = time.perf_counter()
                loss = self._loss(rows, batch_indices(self.step, rows.shape[0], cfg.batch_size, cfg.seed), topk)
                self.optim.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.student.parameters(), cfg.grad_clip)
                self.optim.step()
                self.sched.step()
                self.step += 1
                self.tokens += cfg.batch_size * seq
                recent = (recent + [loss.item()])[-20:]
                bar.update(1)
                bar.set_postfix(loss=f"{sum(recent) / len(recent):.4f}",
                                tok_s=f"{cfg.batch_size * seq / (time.perf_counter() - tick):.0f}")
                if cfg.max_minutes and self._elapsed()["seconds"] > 60 * cfg.max_minutes:
                    end = self.step  # the time budget is spent: this step is the last
                if self.step % cfg.eval_every == 0 or self.step == end:
                    self._record(heldout, sum(recent) / len(recent))
                    bar.write(f"step {self.step}: held-out ppl {self.history[-1]['heldout_ppl']:.3f}, "
                              f"KL {self.history[-1]['heldout_kl']:.4f}")
                if on_step is not None:
                    on_step(self.step)
                if stop:
                    self.save()
                    raise Interrupted(self.step, self.state_path)
                if self.step % cfg.save_every == 0:
                    self.save()
        self.student.eval()
        return self.history
