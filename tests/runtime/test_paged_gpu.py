"""GPU check of issue 29 (marker `gpu`, skipped without onnxruntime-gpu's CUDA provider): a paged fp16
engine run by LLM (PagedAttention over the scheduler's blocks, packed ragged steps, a shared prefix by
reference) generates the same greedy tokens as its GQA fp16 twin and as transformers in fp16 on the GPU,
and runs more sequences at once on the same KV memory."""
from __future__ import annotations

import onnxruntime as ort
import pytest

from tools.gpu.steps import TINY, build, paged_check
from tools.checkpoints.make_checkpoint import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                                                  reason="needs onnxruntime-gpu with CUDAExecutionProvider")]
PROMPTS = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([5, 17, 33, 9])]  # ragged
NEW = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("paged") / "ckpt", **TINY, initializer_range=0.1, seed=0)


def test_paged_engine_matches_gqa_engine(checkpoint, tmp_path):
    prompts = PROMPTS + [PROMPTS[2][:32] + [9, 8, 7]]  # shares two blocks with the third prompt
    longest = max(len(p) for p in prompts) + NEW + 16
    gqa, _ = build(checkpoint, tmp_path / "gqa", "cuda", "float16", "none", 2, longest)
    paged, _ = build(checkpoint, tmp_path / "paged", "cuda", "float16", "none", len(prompts), longest,
                     "target.attention=paged")
    verdict, gqa_peak, paged_peak = paged_check(gqa, paged, prompts, NEW, rows=2)
    assert verdict == "identical"
    assert gqa_peak <= 2 < paged_peak


def test_paged_engine_matches_transformers(checkpoint, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.engine import LLM
    from runtime.request.params import SamplingParams

    engine, _ = build(checkpoint, tmp_path / "paged", "cuda", "float16", "none", len(PROMPTS), 96,
                      "target.attention=paged")
    llm = LLM(engine, device="cuda")
    try:
        got = [r.token_ids for r in llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))]
    finally:
        llm.close()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float16).to("cuda").eval()
    with torch.inference_mode():
        for prompt, tokens in zip(PROMPTS, got):
            out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False)
            assert out[0, len(prompt):].tolist() == tokens
