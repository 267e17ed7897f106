"""A tensor-parallel engine's ranks on their device: each rank's KV shard in the device KV cache (ONNX
Runtime OrtValues bound by pointer, forced on CPU here so CI runs the CUDA code path), each segment binding
only its own layers, prefix copies between slots made by the cache on every rank; and the GPU each rank
computes on (its CUDA provider's device_id), chosen without a GPU from fake device counts."""
from __future__ import annotations

import pytest
from test_tensor_parallel import NEW_TOKENS, build, checkpoint, hf_greedy, prompts, reference  # noqa: F401 (fixtures)

from runtime.config import LoadConfig
from runtime.engine import LLM
from runtime.model.kv_cache import KVCache
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError
from runtime.request.params import SamplingParams
from runtime.parallel.rank import rank_device_id, rank_providers, segment_layers

GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tp2(checkpoint, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    return build(checkpoint, tmp_path_factory.mktemp("tp-device") / "tp2", 2)


@pytest.fixture(scope="module")
def device_llm(tp2):
    llm = LLM(tp2, kv_backend="ortvalue")
    yield llm
    llm.close()


def test_every_rank_keeps_its_kv_in_ortvalues(device_llm):
    assert device_llm.runner.cache.backend == "ortvalue" and device_llm.runner.engine.device_id == 0
    worker = device_llm.runner.workers[0]
    told = LoadConfig.from_json(worker.args[-1])  # rank 1 is told the device and the KV backend
    assert [told.device, told.kv_backend] == ["cpu", "ortvalue"]


def test_ragged_greedy_identical_to_numpy_path_and_transformers(device_llm, tp2, reference):  # noqa: F811
    batch = prompts(reference.config.vocab_size)
    ours = [r.token_ids for r in device_llm.generate(batch, GREEDY)]
    host = LLM(tp2)
    try:
        assert host.runner.cache.backend == "numpy"
        assert ours == [r.token_ids for r in host.generate(batch, GREEDY)]
    finally:
        host.close()
    assert ours == hf_greedy(reference, batch)


def test_prefix_copied_on_every_rank_by_the_device_cache(tp2, reference):  # noqa: F811
    """A prompt sharing a long prefix with a busy sequence copies that KV between slots: rank 0 in its
    cache, rank 1 from the queued copy, both with the ortvalue cache's copy; each request's tokens are
    what transformers gives it alone (a copy missing on either rank would change them)."""
    shared = prompts(reference.config.vocab_size)[2]
    batch = [shared + [9], shared + [40, 41], shared]
    llm = LLM(tp2, kv_backend="ortvalue")
    try:
        first = llm.submit(batch[0], GREEDY)
        next(first.text_stream())  # the first sequence is busy in its slot
        rest = [llm.submit(p, GREEDY) for p in batch[1:]]
        tokens = [h.result(timeout=60).token_ids for h in [first] + rest]
        assert llm.executor.totals["prompt_tokens_reused"] >= 2 * ((len(shared) - 1) // 16 * 16)  # whole blocks
        assert llm.runner.copies_sent >= 1
    finally:
        llm.close()
    assert tokens == hf_greedy(reference, batch)


def test_float16_tp2_on_the_device_path_matches_float16_tp1(checkpoint, tmp_path):  # noqa: F811
    """float16 (the GPU's dtype): the boundary tensors are torch float16 bound as ONNX element type 10 and
    gloo sums them; the ortvalue tp2 engine's greedy tokens are the float16 tp1 engine's."""
    batch = prompts(512)
    tokens = {}
    for tp, kv_backend in ((1, None), (2, "ortvalue")):
        llm = LLM(build(checkpoint, tmp_path / f"fp16-tp{tp}", tp, "target.dtype=float16"), kv_backend=kv_backend)
        try:
            tokens[tp] = [r.token_ids for r in llm.generate(batch, GREEDY)]
        finally:
            llm.close()
    assert tokens[2] == tokens[1]


def test_each_segment_binds_only_its_layers(tp2):
    from runtime.manifest.load import read_manifest

    for rank in read_manifest(tp2).tensor_parallel.ranks:
        layers = [segment_layers(s) for s in rank.segments]
        assert sorted(sum(layers, [])) == [0, 1]  # every layer in exactly one segment
        assert all(len(seg) <= 1 for seg in layers)


class _RecordingBinding:
    def __init__(self):
        self.calls = []

    def bind_input(self, name, device, device_id, element, shape, pointer):
        self.calls.append(("in", name, device, device_id, shape, pointer))

    def bind_output(self, name, device, device_id, element, shape, pointer):
        self.calls.append(("out", name, device, device_id, shape, pointer))


def test_bind_by_layers_binds_those_rows_by_pointer():
    spec = KVCacheSpec(num_layers=3, kv_heads=2, head_dim=4, dtype="float32", slots=4, max_seq_len=8)
    cache = KVCache(spec, backend="ortvalue", device_id=5)
    assert cache.device_id == 0  # a CPU cache has no GPU to choose
    binding = _RecordingBinding()
    cache.bind(binding, 1, 3, layers=[2])
    key, value = cache.row_pointers(2, 1)
    assert binding.calls == [("in", "past_key_2", "cpu", 0, [2, 2, 8, 4], key),
                             ("out", "present_key_2", "cpu", 0, [2, 2, 8, 4], key),
                             ("in", "past_value_2", "cpu", 0, [2, 2, 8, 4], value),
                             ("out", "present_value_2", "cpu", 0, [2, 2, 8, 4], value)]


@pytest.mark.parametrize("rank, device, collective, count, expected", [
    (0, "cuda", "nccl", 2, 0), (1, "cuda", "nccl", 2, 1), (3, "cuda", "nccl", 2, 1), (3, "cuda", "nccl", 4, 3),
    (1, "cuda", "gloo", 2, 0),  # gloo: the ranks share GPU 0 (tools/gpu/check.py's tp2 step)
    (1, "cpu", "gloo", 0, 0),
])
def test_device_id_per_rank(rank, device, collective, count, expected):
    assert rank_device_id(rank, device, collective, count) == expected


def test_nccl_without_a_gpu_is_refused_by_name():
    with pytest.raises(EngineError, match="NCCL needs a GPU, and torch sees 0"):
        rank_device_id(1, "cuda", "nccl", 0)


def test_cuda_provider_carries_the_rank_device_id():
    assert rank_providers(["CUDAExecutionProvider", "CPUExecutionProvider"], 1) == [
        ("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
    assert rank_providers([("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})], 2) == [
        ("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested", "device_id": 2})]
    assert rank_providers(None, 0) == ["CPUExecutionProvider"]


def test_boundary_values_are_device_tensors_reduced_in_place(device_llm):
    """Rank 0's values between segments are torch tensors on the rank's device (CPU here), bound by pointer;
    a collective's output is its input's tensor (the all-reduce sums in place); the step's token ids, lengths
    and logits index are device tensors too, and only total_sequence_length (read on the host) is numpy."""
    import torch

    device_llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine = device_llm.runner.engine
    for call in engine._calls.values():
        for cut, reduced in zip(engine.collectives, call.reduced, strict=True):
            assert call.tensors[cut.output] is call.tensors[cut.input] is reduced
        assert all(isinstance(t, torch.Tensor) and t.device == engine.torch_device for t in call.tensors.values())
        assert {"input_ids", "seqlens_k"} <= set(call.tensors) and call.total.shape == ()


def _gpus() -> int:
    import onnxruntime as ort
    import torch

    return torch.cuda.device_count() if "CUDAExecutionProvider" in ort.get_available_providers() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs, onnxruntime-gpu and torch with CUDA (NCCL)")
def test_nccl_ranks_on_their_own_gpus_match_tp1(tmp_path):
    """On a 2-GPU box: a float16 tp2 engine all-reducing with NCCL, rank r on GPU r, KV and boundary tensors
    on the device, generates the tp1 engine's greedy tokens for a ragged batch (not run here: no GPU)."""
    from tools.checkpoints.make_checkpoint import make_checkpoint
    from tools.gpu.steps import TINY, build as build_gpu

    ckpt = make_checkpoint(tmp_path / "ckpt", **TINY, initializer_range=0.1, seed=3)
    batch = prompts(TINY["vocab_size"])
    tokens = {}
    for tp in (1, 2):
        engine, _ = build_gpu(ckpt, tmp_path / f"tp{tp}", "cuda", "float16", "none", 4, 96,
                              f"parallel.tensor_parallel={tp}")
        llm = LLM(engine)
        try:
            tokens[tp] = [r.token_ids for r in llm.generate(batch, GREEDY)]
            if tp == 2:
                rank0 = llm.runner.engine
                assert rank0.backend == "nccl" and rank0.cache.device == "cuda" and rank0.cache.backend == "ortvalue"
                options = rank0.sessions[0].get_provider_options()["CUDAExecutionProvider"]
                assert options["device_id"] == "0" and str(rank0.torch_device) == "cuda:0"
        finally:
            llm.close()
    assert tokens[2] == tokens[1]


class _FakeGroup:
    """Rank 0's side of a broadcast, recorded: writes `sent` into the tensor it is given."""

    def __init__(self, sent):
        self.sent, self.given = sent, []

    def broadcast(self, tensor, root, timeout=None):
        self.given.append(tensor)
        tensor.copy_(self.sent)
        return self

    def wait(self):
        return True


@pytest.mark.parametrize("collective, staged", [("nccl", True), ("gloo", False)])
def test_step_broadcast_stages_host_tensors_for_nccl(collective, staged):
    """NCCL moves only GPU tensors: a worker's host header is staged through its device (here CPU, so the
    staging is a copy) and the result copied back; gloo broadcasts the host tensor itself."""
    import torch

    from runtime.parallel.rank import RankEngine

    engine = RankEngine.__new__(RankEngine)  # only what broadcast reads
    engine.backend, engine.torch_device = collective, torch.device("cpu")
    engine.group = _FakeGroup(torch.arange(8))
    header = torch.zeros(8, dtype=torch.int64)
    engine.broadcast(header)
    assert header.tolist() == list(range(8)) and (engine.group.given[0] is not header) == staged
