"""GPU checks (marker `gpu`, skipped without onnxruntime-gpu's CUDA provider): fp16 and int4 CUDA engines of a
small and a 1B-shape random Llama. fp16 kernels round differently across batch sizes, padded buckets and
fixed vs actual total lengths, so greedy tokens are compared with transformers' float32 run on the GPU up to
the first position where its top-1/top-2 gap is below GAP_EPS or twice transformers' own float16 error there,
and the first step's logits within LOGIT_ATOL + LOGIT_RTOL * max|logit| or twice that error
(tools/bench/parity.py). `python -m pytest -m gpu tests/runtime` on a GPU
machine with time to spare; a lent GPU's 15 minutes run `python -m tools.gpu.check --quick` instead, which
checks the same things in one call (docs/GPU.md)."""
from __future__ import annotations

from dataclasses import replace

import onnxruntime as ort
import pytest

from runtime.engine import LLM
from runtime.request.params import SamplingParams
from tools.gpu.steps import ONE_B, TINY, build
from tools.bench.parity import GAP_EPS, hf_references, logits_close, tokens_agree
from tools.checkpoints.make_checkpoint import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                                                  reason="needs onnxruntime-gpu with CUDAExecutionProvider")]
NEW = 64
PROMPTS = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([5, 17, 33, 9])]  # ragged
EPS = GAP_EPS["float16"]


@pytest.fixture(scope="module", params=["small", "1b"])
def checkpoint(request, tmp_path_factory):
    dims = TINY if request.param == "small" else ONE_B
    return make_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", **dims, initializer_range=0.1, seed=0)


@pytest.fixture(scope="module")
def references(checkpoint):
    return hf_references(checkpoint, PROMPTS, NEW, "cuda", "float16")


def engine(checkpoint, quant: str):
    out = checkpoint.parent / f"engine-{quant}"
    return out if out.is_dir() else build(checkpoint, out, "cuda", "float16", quant, 32, 160)[0]


def greedy(llm, prompts=PROMPTS, new=NEW) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))]


def test_fp16_greedy_matches_transformers_on_the_gpu(checkpoint, references):
    llm = LLM(engine(checkpoint, "none"), device="cuda")
    assert llm.runner.cache.device == "cuda" and llm.runner.cache.backend == "ortvalue"
    assert llm.runner.session.get_providers()[0] == "CUDAExecutionProvider"
    logits = [llm.runner.prefill(0, [p])[0] for p in PROMPTS]  # before generate: slot 0 is free
    for row, reference in zip(logits, references):
        close, diff = logits_close(row, reference, "float16")
        assert close, f"first-step logits differ by {diff}"
    assert all(tokens_agree(ours, ref, EPS) for ours, ref in zip(greedy(llm), references))
    llm.close()


@pytest.mark.parametrize("quant", ["none", "int4_rtn"])
def test_cuda_graphs_on_and_off_same_tokens(checkpoint, references, quant):
    """Graphs on (fixed total length, padded bucket) vs off: the same tokens over the reference's trusted length."""
    on, off = (LLM(engine(checkpoint, quant), device="cuda", graph_decode=g) for g in (True, False))
    assert on.runner.graph_buckets and not off.runner.graph_buckets
    for a, b, ref in zip(greedy(on), greedy(off), references):
        assert tokens_agree(a, replace(ref, tokens=b), EPS)
    on.close(), off.close()


def test_32_concurrent_requests_get_their_tokens_alone(checkpoint):
    """Batch 32 vs batch 1 (different kernels): each request's tokens over its own reference's trusted length."""
    prompts = [[3 + (5 * i + j) % 200 for j in range(4 + i % 13)] for i in range(32)]
    llm = LLM(engine(checkpoint, "none"), device="cuda")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    together = [h.result(timeout=600).token_ids for h in [llm.submit(p, params) for p in prompts]]
    alone = LLM(engine(checkpoint, "none"), device="cuda", max_batch_size=1)
    singles = [greedy(alone, [p], 24)[0] for p in prompts]
    references = hf_references(checkpoint, prompts, 24, "cuda", "float16")
    assert all(tokens_agree(t, ref, EPS) and tokens_agree(s, ref, EPS)
               for t, s, ref in zip(together, singles, references))
    llm.close(), alone.close()


def test_overlap_is_on_by_default_and_changes_no_token(checkpoint):
    """Issue 28: on CUDA the engine call runs on its own thread while the last step's text is rendered, and decode
    steps run ahead (lookahead 16: each fed the last one's ids on the engine thread); the tokens, text and finish
    reasons (stop strings found a step late included) equal those of overlap off. Its speed: tools.gpu.check's
    step-overlap step."""
    on, off = (LLM(engine(checkpoint, "none"), device="cuda", overlap=o) for o in (None, False))
    assert on.executor._engine is not None and off.executor._engine is None
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    plain = off.generate(PROMPTS, params)
    assert [c.token_ids for c in on.generate(PROMPTS, params)] == [c.token_ids for c in plain]
    # a stop string found a step late leaves one more row in that step's batch (fp16 kernels differ by batch
    # size), so each prompt runs alone here
    for prompt, done in zip(PROMPTS, plain):
        stop = SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop=[done.text[len(done.text) // 2:][:2] or "\n"])
        ours, theirs = on.generate([prompt], stop)[0], off.generate([prompt], stop)[0]
        assert (ours.token_ids, ours.text, ours.finish_reason) == (theirs.token_ids, theirs.text, theirs.finish_reason)
    on.close(), off.close()
