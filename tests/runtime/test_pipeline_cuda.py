"""Pipeline stages on CUDA. Without a GPU: the stage's placement (providers on GPU 0, tensors there) from a fake
providers list; an engine built for cuda float16 and split in two, loaded on the CPU (float16 runs there), gives
the pp1 twin's tokens, with the KV in device-style buffers (kv_backend ortvalue, the CUDA code path) too; what a
stage cannot do is refused by name before a stage starts. On a GPU (marker `gpu`): pp2 with both stages on the one
GPU against pp1, identical greedy tokens (tools/gpu/check.py's `pp-cuda` step runs the same on a lent GPU)."""
from __future__ import annotations

import onnxruntime as ort
import pytest
import torch

from runtime.engine import LLM
from runtime.manifest.load import EngineError
from runtime.parallel.stage import STAGE_GPU, placement
from tests.runtime.test_pipeline_parallel import build, checkpoint, in_flight, prompts  # noqa: F401  (fixtures)

CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()


def test_a_cuda_stage_runs_on_gpu_0_with_its_tensors_there():
    chosen, device = placement("cuda", CUDA, cuda_in_torch=True)
    assert chosen == [("CUDAExecutionProvider", {"device_id": STAGE_GPU}), "CPUExecutionProvider"]
    assert device == torch.device("cuda", STAGE_GPU)
    assert placement("cpu", ["CPUExecutionProvider"], cuda_in_torch=True) == (["CPUExecutionProvider"],
                                                                             torch.device("cpu"))


def test_a_cuda_stage_without_cuda_in_torch_is_refused_by_name():
    with pytest.raises(EngineError, match="pipeline stage on cuda .* this torch .* has no CUDA.*device='cpu'"):
        placement("cuda", CUDA, cuda_in_torch=False)


@pytest.fixture(scope="module")
def cuda_engines(checkpoint, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("pp-cuda")
    target = ("target.device=cuda", "target.dtype=float16")
    return {p: build(checkpoint, root / f"pp{p}", *target, f"parallel.pipeline_parallel={p}") for p in (1, 2)}


@pytest.mark.parametrize("kv_backend", [None, "ortvalue"])
def test_a_cuda_pp2_engine_loaded_on_cpu_gives_pp1s_tokens(cuda_engines, kv_backend):
    batch = prompts(512)
    one = in_flight(cuda_engines[1], batch, 8, device="cpu", kv_backend=kv_backend)[0]
    two, stats, _ = in_flight(cuda_engines[2], batch, 8, device="cpu", kv_backend=kv_backend)
    assert stats["virtual_engines"] == 2
    assert two == one


@pytest.mark.skipif(HAS_CUDA, reason="the refusal is what a machine without CUDA gets")
def test_cuda_without_a_gpu_is_refused_before_any_stage_starts(cuda_engines, monkeypatch):
    import runtime.parallel.pipeline_runner as pipeline_runner

    monkeypatch.setattr(pipeline_runner, "spawn", lambda *a: pytest.fail("a stage started"))
    with pytest.raises(EngineError, match="device 'cuda' needs CUDAExecutionProvider"):
        LLM(cuda_engines[2], device="cuda")


def test_graph_decode_is_refused_by_name(cuda_engines):
    with pytest.raises(EngineError, match="graph_decode .* not supported by a pipeline-parallel engine's stages"):
        LLM(cuda_engines[2], device="cpu", graph_decode=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu's CUDAExecutionProvider and torch with CUDA")
def test_pp2_with_both_stages_on_the_gpu_gives_pp1s_tokens(checkpoint, tmp_path):  # noqa: F811
    from tools.gpu.steps import pp2_on_one_device

    batch = prompts(512)[:4]
    verdicts = pp2_on_one_device(checkpoint, tmp_path, "cuda", "float16", batch, 16)
    assert set(verdicts.values()) == {"identical"}, verdicts
