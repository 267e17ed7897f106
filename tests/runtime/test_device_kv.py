"""The device KV-cache path (ONNX Runtime-allocated OrtValues bound by pointer) run on CPU: the same code
as on CUDA with device "cpu", so CI proves it gives the tokens of the numpy fast path."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import onnxruntime as ort
from click.testing import CliRunner

from runtime.cli import main as run_cli
from runtime.engine import LLM
from runtime.model.device import providers
from runtime.model.kv_cache import KVCache
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError
from runtime.request.params import SamplingParams
from runtime.batching.block_table import BlockConfig
from runtime.batching.scheduler import Scheduler
from runtime.request.sequence import Sequence
from runtime.speculation.speculator import Speculation

SPEC = KVCacheSpec(num_layers=2, kv_heads=2, head_dim=4, dtype="float32", slots=3, max_seq_len=8)


@pytest.fixture(scope="module")
def pair(tiny_engine):
    host, device = LLM(tiny_engine), LLM(tiny_engine, kv_backend="ortvalue")
    yield host, device
    host.close(), device.close()


def fill(cache: KVCache, seed: int) -> list[np.ndarray]:
    """Write random KV into every buffer of an ortvalue cache through its pointers; returns the host copies."""
    rng = np.random.default_rng(seed)
    written = []
    for buffer in cache.keys + cache.values:
        data = rng.standard_normal(cache.spec.buffer_shape).astype(np.float32)
        view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_float * data.size).from_address(buffer.data_ptr()))
        view[:] = data.ravel()
        written.append(data)
    return written


def test_ortvalue_cache_is_ort_allocated_and_zeroed():
    cache = KVCache(SPEC, backend="ortvalue")
    assert cache.keys[0].shape() == list(SPEC.buffer_shape) and cache.keys[0].device_name() == "cpu"
    k, v = cache.rows(1, 0, 3)
    assert not k.any() and not v.any()
    assert cache.row_pointers(1, 2)[0] == cache.keys[1].data_ptr() + 2 * SPEC.kv_heads * 8 * 4 * 4


def test_prefix_copy_stays_in_place_and_copies_only_the_prefix(pair):
    cache = KVCache(SPEC, backend="ortvalue")
    before = fill(cache, 0)
    scheduler = Scheduler(cache, SPEC.slots, 64, 2, BlockConfig(SPEC.slots * 4, 2))

    def admit(prompt):
        seq = Sequence(prompt, SamplingParams(max_new_tokens=1), pair[0].tokenizer, frozenset())
        scheduler.add(seq)
        scheduler.schedule()
        return seq

    first = admit([1, 2, 3, 4, 5, 6, 7])
    scheduler.advance([first], 6)
    scheduler.retire(first)  # its 3 full blocks stay cached in its row
    busy = admit([1, 2, 3, 4, 5, 6, 7])
    assert busy.reused == 6 and busy.slot == first.slot  # in place
    other = admit([1, 2, 3, 4, 9])  # the prefix is held by a busy row: copied
    slot, busy = other.slot, busy.slot
    assert other.reused == 4 and slot != busy
    for layer in range(SPEC.num_layers):
        for got, old in zip(cache.rows(layer, 0, 3), (before[layer], before[SPEC.num_layers + layer])):
            np.testing.assert_array_equal(got[slot, :, :4], old[busy, :, :4])
            np.testing.assert_array_equal(got[slot, :, 4:], old[slot, :, 4:])
            np.testing.assert_array_equal(got[busy], old[busy])


def test_bfloat16_buffers_are_allocated_by_onnxruntime():
    spec = dataclasses.replace(SPEC, dtype="bfloat16")
    cache = KVCache(spec)  # numpy has no bfloat16: the default backend is ortvalue
    assert cache.backend == "ortvalue" and cache.keys[0].data_type() == "tensor(bfloat16)"
    assert cache.keys[0].tensor_size_in_bytes() == spec.slots * cache.row_bytes
    with pytest.raises(ValueError, match="numpy KV cache holds only CPU float32/float16"):
        KVCache(spec, backend="numpy")


def test_bad_device_or_backend_named():
    with pytest.raises(ValueError, match="allowed devices"):
        KVCache(SPEC, device="tpu")
    with pytest.raises(ValueError, match="backends"):
        KVCache(SPEC, backend="torch")


def test_greedy_and_seeded_tokens_identical_to_numpy_path(pair):
    host, device = pair
    prompts = [[7 + i] * (3 + 5 * i) for i in range(4)]  # ragged
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=s, max_new_tokens=12, ignore_eos=True)
               for s in range(4)]
    for params in (greedy, sampled):
        assert ([r.token_ids for r in device.generate(prompts, params)]
                == [r.token_ids for r in host.generate(prompts, params)])


def test_concurrent_prefix_reuse_and_speculation_match_numpy_path(tiny_engine):
    system = list(range(100, 140))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    expected = LLM(tiny_engine, min_prefix_reuse=10_000).generate([system + [5], system + [6, 7]], params)
    llm = LLM(tiny_engine, kv_backend="ortvalue", max_batch_size=2, min_prefix_reuse=8)
    running = llm.submit(system + [5], params)
    next(iter(running))  # decoding: the second request's prefix is copied from its slot on the device
    second = llm.submit(system + [6, 7], params).result(timeout=30)
    assert second.metrics["reused_prompt_tokens"] == 32  # the two whole 16-token blocks of the 40
    assert [running.result(timeout=30).token_ids, second.token_ids] == [e.token_ids for e in expected]
    spec = llm.generate([system + system[:10]], params, speculation=Speculation("ngram"))[0]
    assert spec.token_ids == LLM(tiny_engine).generate([system + system[:10]], params)[0].token_ids
    llm.close()


def test_device_choice_errors_say_what_to_do(tiny_engine):
    with pytest.raises(EngineError, match="float32 engine cannot run on cuda"):
        LLM(tiny_engine, device="cuda")
    with pytest.raises(EngineError, match="not one of"):
        LLM(tiny_engine, device="tpu")
    assert LLM(tiny_engine, device="cpu").device == "cpu"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(EngineError, match=r"needs CUDAExecutionProvider.*(no NVIDIA driver|onnxruntime-gpu)"):
            providers({"target": {"device": "cpu"}}, "cuda")


def test_engine_run_device_option(tiny_engine):
    result = CliRunner().invoke(run_cli, ["--engine", str(tiny_engine), "--prompt", "def", "--max-new-tokens", "3",
                                          "--device", "cuda"])
    assert result.exit_code == 2 and "float32 engine cannot run on cuda" in result.output
    ok = CliRunner().invoke(run_cli, ["--engine", str(tiny_engine), "--prompt", "def", "--max-new-tokens", "3",
                                      "--device", "cpu"])
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("kv_backend", ["numpy", "ortvalue"])
def test_fixed_buffer_bucket_decode_gives_the_same_tokens(tiny_engine, kv_backend):
    """The CUDA-graph decode path without capture: rows [0, bucket) on buffers bound once, padded, at
    total_sequence_length = the KV length; ragged batches, concurrent requests and speculation on top."""
    llm = LLM(tiny_engine, kv_backend=kv_backend, graph_decode=True, max_batch_size=3)
    plain = LLM(tiny_engine, max_batch_size=3)
    assert llm.runner.graph_buckets == [1, 2, 3]
    prompts = [[7 + i] * (3 + 5 * i) for i in range(5)]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=20, seed=1, max_new_tokens=10, ignore_eos=True)] * 2 + [
              SamplingParams(max_new_tokens=10, ignore_eos=True, repetition_penalty=1.2)]
    assert [r.token_ids for r in llm.generate(prompts, params)] == [r.token_ids for r in plain.generate(prompts, params)]
    assert {rows for rows, _ in llm.runner._graph_calls} <= {1, 2, 3} and llm.runner._graph_calls
    handles = [llm.submit(p, params[0]) for p in prompts]
    assert [h.result(timeout=60).token_ids for h in handles] == [r.token_ids for r in plain.generate(prompts, params[0])]
    text = list(range(30, 50)) * 2
    assert (llm.generate([text], params[0], speculation=Speculation("ngram"))[0].token_ids
            == plain.generate([text], params[0])[0].token_ids)
    llm.close(), plain.close()


def test_bfloat16_rotary_tables_round_like_torch():
    import torch

    from runtime.model.rotary import bfloat16_bits

    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bfloat16_bits(x), expected)


def test_fixed_buffer_decode_with_rows_out_of_slot_order(tiny_engine):
    """A request admitted into a row freed below a running one: the running order (admission) is no longer the
    slot order, and every row of the bucket decodes; each token must still go to its own row."""
    llm = LLM(tiny_engine, graph_decode=True, max_batch_size=2)
    plain = LLM(tiny_engine, max_batch_size=2)
    prompts = [[5, 6, 7], [9] * 6, [11, 12] * 4]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 16, 16)]
    expected = [plain.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    llm.close(), plain.close()


@pytest.mark.parametrize("kv_backend", ["numpy", "ortvalue"])
def test_steps_run_ahead_on_fixed_buffers(tiny_engine, kv_backend):
    """The CUDA configuration on CPU: fixed-buffer bucket decode with overlap and steps run ahead, rows finishing
    at different lengths inside chains, requests admitted into freed rows below running ones, greedy and top-k
    rows: the same tokens as the plain executor."""
    llm = LLM(tiny_engine, kv_backend=kv_backend, graph_decode=True, overlap=True, lookahead=6, max_batch_size=3)
    plain = LLM(tiny_engine, max_batch_size=3)
    prompts = [[7 + i] * (3 + 4 * i) for i in range(7)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 17, 9, 22, 5, 14, 11)]
    params[4] = SamplingParams(temperature=0.9, top_k=20, seed=5, max_new_tokens=12, ignore_eos=True)
    expected = [plain.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    assert llm.executor.totals["steps_run_ahead"] > 0
    llm.close(), plain.close()
