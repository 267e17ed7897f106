"""Greedy parity against transformers that survives kernels rounding differently (fp16 on a GPU, batch 1
vs 32, padded buckets, fixed vs actual total length): tokens are compared up to the first position where the
reference's top-1/top-2 logit gap is below GAP_EPS (after it, either token is a correct greedy choice, and
the two continuations diverge legitimately), and the first step's logits within LOGIT_ATOL + LOGIT_RTOL *
max|logit|. Used by tests/runtime/test_gpu.py and tools.gpu.check's correctness steps.

A half-precision engine is held against the float32 truth, not against transformers' own half-precision run:
on random weights with a large residual stream (the 1B-shape check checkpoint reaches |h| ~ 2000, where a
float16 ulp is 1-2) transformers' float16 logits are themselves 0.4 away from its float32 ones (measured
2026-11-26, CPU), so two correct float16 implementations differ by more than any fixed bound. The reference
is float32, and its `noise` (per step: the largest |float16 - float32| logit of transformers' own half run on
the same tokens) widens both bounds: a step is trusted only when its gap exceeds twice that noise, and the first
logits may be as far from the truth as twice transformers' own half-precision error."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    noise: list[float] | None = None  # per step: transformers' own half-precision error (None: float32 compared)


def trusted_length(reference: Reference, eps: float) -> int:
    """How many leading tokens any correct greedy decoder must reproduce: those before the first step whose
    top-2 gap is below `eps`, or below twice the reference's half-precision noise there (that step may pick either
    token, and later steps follow a different past)."""
    noise = reference.noise or [0.0] * len(reference.gaps)
    close = [i for i, (gap, n) in enumerate(zip(reference.gaps, noise)) if gap < max(eps, 2 * n)]
    return close[0] if close else len(reference.tokens)


def tokens_agree(ours: list[int], reference: Reference, eps: float) -> bool:
    """Whether `ours` equals the reference over its trusted length."""
    n = trusted_length(reference, eps)
    return list(ours[:n]) == list(reference.tokens[:n])


def logits_close(ours: np.ndarray, reference: Reference, dtype: str) -> tuple[bool, float]:
    """(within tolerance, max |ours - reference|) for one first-step logits row."""
    diff = float(np.abs(np.asarray(ours, np.float32) - reference.first_logits).max())
    bound = LOGIT_ATOL[dtype] + LOGIT_RTOL * float(np.abs(reference.first_logits).max())
    if reference.noise:
        bound = max(bound, 2 * reference.noise[0])
    return diff <= bound, diff


def hf_references(checkpoint, prompts: list[list[int]], new_tokens: int, device: str, dtype: str) -> list[Reference]:
    """transformers' float32 greedy continuation of each prompt alone on `device`, with its step gaps; for a half
    `dtype`, with each step's noise: how far transformers' own `dtype` logits are from them on the same tokens."""
    import torch

    model = _model(checkpoint, device, "float32")
    half = None if dtype == "float32" else _model(checkpoint, device, dtype)
    with torch.inference_mode():
        return [_reference(model, half, prompt, new_tokens, device) for prompt in prompts]


def _model(checkpoint, device: str, dtype: str):
    """transformers' model of a checkpoint directory, or of a GGUF file (dequantized by transformers itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(checkpoint)
    where = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name} if path.suffix == ".gguf" else \
        {"pretrained_model_name_or_path": path}
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=getattr(torch, dtype)).to(device).eval()
    # like ignore_eos: EOS is an ordinary token (min_new_tokens would mask it out of the choice)
    model.generation_config.eos_token_id = None
    return model


def _reference(model, half, prompt: list[int], new_tokens: int, device: str) -> Reference:
    import torch

    ids = torch.tensor([prompt], device=device)  # an explicit mask: generate would mask prompt tokens equal to pad
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    logits = torch.cat(out.logits).float()  # [new_tokens, vocab]
    top2 = logits.topk(2, dim=-1).values
    tokens = out.sequences[0, len(prompt):].tolist()
    noise = None
    if half is not None:  # the half model on the float32 path's tokens, one teacher-forced call
        forced = torch.tensor([prompt + tokens[:-1]], device=device)
        half_logits = half(forced, attention_mask=torch.ones_like(forced)).logits[0, len(prompt) - 1:].float()
        noise = (half_logits - logits).abs().amax(dim=-1).tolist()
    return Reference(tokens, (top2[:, 0] - top2[:, 1]).tolist(), logits[0].cpu().numpy(), noise)
