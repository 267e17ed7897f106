"""GPU checks of issue 15 (marker `gpu`, skipped without onnxruntime-gpu's CUDA provider): fp16 and int4
CUDA engines of a small and a 1B-shape random Llama; greedy tokens identical to transformers on the GPU over
64 tokens for a ragged batch; CUDA graphs on and off give the same tokens; 32 concurrent requests through
the executor each get the tokens they get alone. Run them all with `python -m tools.bench.gpu_check`."""
from __future__ import annotations

import onnxruntime as ort
import pytest

from runtime.engine import LLM
from runtime.request.params import SamplingParams
from tools.bench.gpu_check import ONE_B, TINY, build
from tools.checkpoints.make_checkpoint import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                                                  reason="needs onnxruntime-gpu with CUDAExecutionProvider")]
NEW = 64
PROMPTS = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([5, 17, 33, 9])]  # ragged


@pytest.fixture(scope="module", params=["small", "1b"])
def checkpoint(request, tmp_path_factory):
    dims = TINY if request.param == "small" else ONE_B
    return make_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", **dims, initializer_range=0.1, seed=0)


def engine(checkpoint, quant: str):
    out = checkpoint.parent / f"engine-{quant}"
    return out if out.is_dir() else build(checkpoint, out, "cuda", "float16", quant, 32, 160)[0]


def reference_tokens(checkpoint) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float16).to("cuda").eval()
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device="cuda")
            gen = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            out.append(gen[0, len(prompt):].tolist())
    return out


def greedy(llm) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))]


def test_fp16_greedy_identical_to_transformers_on_the_gpu(checkpoint):
    llm = LLM(engine(checkpoint, "none"), device="cuda")
    assert llm.runner.cache.device == "cuda" and llm.runner.cache.backend == "ortvalue"
    assert greedy(llm) == reference_tokens(checkpoint)
    llm.close()


@pytest.mark.parametrize("quant", ["none", "int4_rtn"])
def test_cuda_graphs_on_and_off_same_tokens(checkpoint, quant):
    on, off = (LLM(engine(checkpoint, quant), device="cuda", graph_decode=g) for g in (True, False))
    assert on.runner.graph_buckets and not off.runner.graph_buckets
    assert greedy(on) == greedy(off)
    on.close(), off.close()


def test_32_concurrent_requests_get_their_tokens_alone(checkpoint):
    llm = LLM(engine(checkpoint, "none"), device="cuda")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = [[3 + (5 * i + j) % 200 for j in range(4 + i % 13)] for i in range(32)]
    handles = [llm.submit(p, params) for p in prompts]
    together = [h.result(timeout=600).token_ids for h in handles]
    alone = LLM(engine(checkpoint, "none"), device="cuda", max_batch_size=1)
    assert together == [alone.generate([p], params)[0].token_ids for p in prompts]
    llm.close(), alone.close()
