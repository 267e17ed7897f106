"""Draft mode: a student distilled to draft for a target in speculative decoding. The student must share the
target's tokenizer (checked before any work), and it learns on the target's own greedy continuations (on-policy
data, as DistillSpec does) besides the text: what speculation accepts is agreement with the target on the very
contexts greedy decoding produces."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from builder.compress.data import batches
from builder.compress.plan import CompressError


def check_same_tokenizer(student_tok, target_tok, student: str | Path, target: str | Path) -> None:
    """Raise CompressError unless both tokenizers map the same strings to the same ids with the same eos."""
    a, b = student_tok.get_vocab(), target_tok.get_vocab()
    if a != b:
        differing = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        raise CompressError(
            f"--draft-for: the draft's tokenizer ({student}, {len(a)} tokens) differs from the target's ({target}, "
            f"{len(b)} tokens), e.g. {differing}; a draft must share its target's tokenizer: start from a model "
            f"with the target's tokenizer (or prune the target itself)")
    if student_tok.eos_token_id != target_tok.eos_token_id:
        raise CompressError(f"--draft-for: the draft's end-of-text id ({student_tok.eos_token_id}) differs from the "
                            f"target's ({target_tok.eos_token_id})")


@torch.no_grad()
def on_policy_rows(target, prompts: torch.Tensor, prompt_len: int, device: str = "cpu",
                   batch_size: int = 16) -> torch.Tensor:
    """Each row's first `prompt_len` tokens continued greedily by the target to the row's length:
    [n, seq + 1], the same shape as `prompts`."""
    new_tokens = prompts.shape[1] - prompt_len
    if not 0 < prompt_len < prompts.shape[1]:
        raise CompressError(f"--prompt-len must be in 1..{prompts.shape[1] - 1}, got {prompt_len}")
    target = target.to(device).eval()
    out = []
    for batch in tqdm(list(batches(prompts[:, :prompt_len], batch_size)), desc="target generations", unit="batch",
                      dynamic_ncols=True):
        ids = target.generate(batch.to(device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=target.config.eos_token_id)
        out.append(ids.cpu())
    return torch.cat(out)


def read_prompts(path: str | Path) -> list[str]:
    """A chat prompt file: one user message per non-empty line (a `#` line is a comment)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise CompressError(f"--chat-prompts {path}: {err.strerror}; give a text file, one user message a line")
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise CompressError(f"--chat-prompts {path}: no prompts; give one user message a line")
    return prompts


@torch.no_grad()
def chat_stream(target, tokenizer, prompts: list[str], new_tokens: int, device: str = "cpu",
                batch_size: int = 16) -> torch.Tensor:
    """The target's greedy answers to chat prompts (each rendered with the chat template), every conversation
    (prompt, answer up to `new_tokens` or its end-of-turn) concatenated into one token stream: on-policy text in
    the shape drafting meets at serving time."""
    if tokenizer.chat_template is None:
        raise CompressError("--chat-prompts: the target's tokenizer has no chat template; use --on-policy instead")
    target = target.to(device).eval()
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) for p in prompts]
    pad, side = tokenizer.pad_token_id, tokenizer.padding_side
    tokenizer.padding_side = "left"
    if pad is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    stream: list[int] = []
    try:
        for first in tqdm(range(0, len(rendered), batch_size), desc="target chat answers", unit="batch",
                          dynamic_ncols=True):
            enc = tokenizer(rendered[first: first + batch_size], return_tensors="pt", padding=True,
                            add_special_tokens=False)
            ids = target.generate(**enc.to(device), max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id)
            for row, mask in zip(ids.cpu(), enc.attention_mask.cpu()):
                prompt_len = mask.numel()
                stream += row[prompt_len - int(mask.sum()): prompt_len].tolist()
                stream += _until_end(row[prompt_len:].tolist(), tokenizer.eos_token_id)
    finally:
        tokenizer.padding_side, tokenizer.pad_token_id = side, pad
    return torch.tensor(stream, dtype=torch.int64)


def _until_end(answer: list[int], eos: int) -> list[int]:
    return answer[: answer.index(eos) + 1] if eos in answer else answer


@torch.no_grad()
def greedy_agreement(draft, target, rows: torch.Tensor, batch_size: int = 8) -> float:
    """Fraction of positions where the draft's argmax equals the target's (the per-token greedy acceptance)."""
    agree = total = 0
    for batch in batches(rows, batch_size):
        a = draft(input_ids=batch, use_cache=False).logits.argmax(-1)
        b = target(input_ids=batch, use_cache=False).logits.argmax(-1)
        agree += (a == b).sum().item()
        total += a.numel()
    return agree / total
