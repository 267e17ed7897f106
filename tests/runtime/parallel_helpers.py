"""What the tensor- and pipeline-parallel tests share: transformers' greedy tokens, and an engine's logits for
every real token of a right-padded ragged batch in one runner call."""
from __future__ import annotations

import signal
import time

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


def assert_every_token_logits(engine_dir, reference, batch: list[list[int]], atol: float) -> None:
    """The engine's logits of every prompt token (every_token_logits) within `atol` of transformers' `reference`
    on each prompt alone."""
    from runtime.engine import LLM

    llm = LLM(engine_dir)
    try:
        ours = every_token_logits(llm, batch)
    finally:
        llm.close()
    with torch.no_grad():
        for p, got in zip(batch, ours):
            np.testing.assert_allclose(got, reference(torch.tensor([p])).logits[0].numpy(), atol=atol, rtol=0)


def hung_worker_ends_the_engine(llm, worker: int) -> None:
    """Stop worker process `worker` (SIGSTOP): the next request ends with rank 0's receive timeout (the caller
    sets it to 3 s) within 30 s, and closing the engine ends every worker."""
    from runtime.request.params import SamplingParams

    workers = llm.runner.workers
    try:
        workers[worker].send_signal(signal.SIGSTOP)
        start = time.perf_counter()
        result = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))[0]
        assert result.finish_reason == "error" and "timed out after 3 s" in result.error
        assert time.perf_counter() - start < 30
    finally:
        llm.close()
    assert all(w.poll() is not None for w in workers)
