"""What the tensor- and pipeline-parallel tests share: transformers' greedy tokens, and an engine's logits for
every real token of a right-padded ragged batch in one runner call."""
from __future__ import annotations

import numpy as np
import torch


def hf_greedy(model, batch: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone, `new` tokens, EOS an ordinary token."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in batch]


def every_token_logits(llm, batch: list[list[int]]) -> list[np.ndarray]:
    """The runner's logits of every prompt token, the prompts right-padded into one call: [len(p), vocab] each."""
    lens = np.array([len(p) for p in batch])
    ids = np.array([p + [0] * (lens.max() - len(p)) for p in batch], dtype=np.int64)
    index = np.flatnonzero(np.arange(lens.max())[None, :] < lens[:, None])  # every real token's logits
    return np.split(llm.runner.run(0, ids, lens - 1, int(lens.max()), index), np.cumsum(lens)[:-1])
