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
