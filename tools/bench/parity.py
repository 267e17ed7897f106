"""Greedy parity against transformers that survives kernels rounding differently (fp16 on a GPU, batch 1
vs 32, padded buckets, fixed vs actual total length): tokens are compared up to the first position where the
reference's top-1/top-2 logit gap is below GAP_EPS (after it, either token is a correct greedy choice, and
the two continuations diverge legitimately), and the first step's logits within LOGIT_ATOL + LOGIT_RTOL *
max|logit|. Used by tests/runtime/test_gpu.py and tools.gpu.check's correctness steps."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GAP_EPS = {"float16": 0.05, "bfloat16": 0.25, "float32": 1e-3}  # logits; a few half-precision ulps at |logit| ~ 10
LOGIT_ATOL = {"float16": 0.05, "bfloat16": 0.25, "float32": 1e-3}
LOGIT_RTOL = 0.01


@dataclass
class Reference:
    """transformers' greedy continuation of one prompt: its tokens, the top-1/top-2 logit gap at each step and
    the first step's logits (float32 [vocab])."""

    tokens: list[int]
    gaps: list[float]
    first_logits: np.ndarray


def trusted_length(reference: Reference, eps: float) -> int:
    """How many leading tokens any correct greedy decoder must reproduce: those before the first step whose
    top-2 gap is below `eps` (that step may pick either token, and later steps follow a different past)."""
    close = [i for i, gap in enumerate(reference.gaps) if gap < eps]
    return close[0] if close else len(reference.tokens)


def tokens_agree(ours: list[int], reference: Reference, eps: float) -> bool:
    """Whether `ours` equals the reference over its trusted length."""
    n = trusted_length(reference, eps)
    return list(ours[:n]) == list(reference.tokens[:n])


def logits_close(ours: np.ndarray, reference: Reference, dtype: str) -> tuple[bool, float]:
    """(within tolerance, max |ours - reference|) for one first-step logits row."""
    diff = float(np.abs(np.asarray(ours, np.float32) - reference.first_logits).max())
    bound = LOGIT_ATOL[dtype] + LOGIT_RTOL * float(np.abs(reference.first_logits).max())
    return diff <= bound, diff


def hf_references(checkpoint, prompts: list[list[int]], new_tokens: int, device: str, dtype: str) -> list[Reference]:
    """transformers' greedy continuation of each prompt alone, in `dtype` on `device`, with its step gaps."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).to(device).eval()
    # like ignore_eos: EOS is an ordinary token (min_new_tokens would mask it out of the choice), and an explicit
    # mask (generate would otherwise mask every prompt token equal to the pad id)
    model.generation_config.eos_token_id = None
    references = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            logits = torch.cat(out.logits).float()  # [new_tokens, vocab]
            top2 = logits.topk(2, dim=-1).values
            references.append(Reference(out.sequences[0, len(prompt):].tolist(),
                                        (top2[:, 0] - top2[:, 1]).tolist(), logits[0].cpu().numpy()))
    return references
