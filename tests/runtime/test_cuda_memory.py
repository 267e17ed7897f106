"""The CUDA KV cache's own memory work, on CPU through a fake cuda-python runtime that records its calls
and does them on host memory: buffers from cudaMalloc (outside ONNX Runtime's arena), zeroed, and every
prefix copy followed by a device synchronize before the cache returns (ONNX Runtime's stream is not
ordered after the default stream that cudaMemcpy2D / cudaMemset run on)."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

import runtime.model.cuda_memory as cuda_memory
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.model.kv_cache import KVCache

SPEC = KVCacheSpec(num_layers=2, slots=3, kv_heads=2, max_seq_len=8, head_dim=4, dtype="float16")


class FakeCudart:
    """cudaMalloc / cudaFree / cudaMemset / cudaMemcpy(2D) / cudaSetDevice / cudaDeviceSynchronize on host memory."""

    cudaMemcpyKind = SimpleNamespace(cudaMemcpyDeviceToDevice=3, cudaMemcpyDeviceToHost=2)

    def __init__(self):
        self.calls: list[str] = []
        self.blocks: dict[int, ctypes.Array] = {}

    def _did(self, name: str, *result):
        self.calls.append(name)
        return (0, *result)

    def cudaMalloc(self, size):
        block = (ctypes.c_char * size)(*([b"\xff"] * size))  # garbage, as real fresh memory may be
        self.blocks[ctypes.addressof(block)] = block
        return self._did("cudaMalloc", ctypes.addressof(block))

    def cudaFree(self, pointer):
        return self._did("cudaFree")

    def cudaMemset(self, pointer, value, count):
        ctypes.memset(pointer, value, count)
        return self._did("cudaMemset")

    def cudaMemcpy(self, dst, src, count, kind):
        ctypes.memmove(dst, src, count)
        return self._did("cudaMemcpy")

    def cudaMemcpy2D(self, dst, dpitch, src, spitch, width, height, kind):
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
        return self._did("cudaMemcpy2D")

    def cudaSetDevice(self, device):
        return self._did("cudaSetDevice")

    def cudaDeviceSynchronize(self):
        return self._did("cudaDeviceSynchronize")


@pytest.fixture
def fake(monkeypatch):
    runtime = FakeCudart()
    monkeypatch.setattr(cuda_memory, "cudart", lambda: runtime)
    return runtime


def test_cuda_buffers_come_from_cudamalloc_zeroed_and_synchronized(fake):
    cache = KVCache(SPEC, "cuda", "ortvalue")
    assert fake.calls.count("cudaMalloc") == 2 * SPEC.num_layers
    assert all(c in fake.calls for c in ("cudaMemset", "cudaDeviceSynchronize"))
    last_memset = max(i for i, c in enumerate(fake.calls) if c == "cudaMemset")
    assert "cudaDeviceSynchronize" in fake.calls[last_memset:]
    key, value = cache.rows(0, 0, SPEC.slots)
    assert key.shape == (SPEC.slots, SPEC.kv_heads, SPEC.max_seq_len, SPEC.head_dim) and not key.any() and not value.any()
    assert cache.row_pointers(1, 2)[0] == cache.keys[1].data_ptr() + 2 * cache.row_bytes


def test_prefix_copy_is_complete_before_the_cache_returns(fake):
    cache = KVCache(SPEC, "cuda", "ortvalue")
    rng = np.random.default_rng(0)
    for buffer in cache.keys + cache.values:  # what attention would have written into slot 0
        data = rng.standard_normal(SPEC.buffer_shape[1:]).astype(np.float16)  # slot 0 only
        ctypes.memmove(buffer.data_ptr(), data.ctypes.data, data.nbytes)
    fake.calls.clear()
    cache.copy_prefix(0, 2, 5)
    assert fake.calls.count("cudaMemcpy2D") == 2 * SPEC.num_layers
    assert fake.calls[-1] == "cudaDeviceSynchronize"  # after the last copy, before ONNX Runtime runs again
    for layer in range(SPEC.num_layers):
        key, value = cache.rows(layer, 0, SPEC.slots)
        assert key[0].any()
        np.testing.assert_array_equal(key[2, :, :5], key[0, :, :5])
        np.testing.assert_array_equal(value[2, :, :5], value[0, :, :5])
        assert not key[2, :, 5:].any() and not key[1].any()


def test_cpu_device_path_needs_no_cuda(monkeypatch):
    monkeypatch.setattr(cuda_memory, "cudart", lambda: pytest.fail("CPU buffers must not call CUDA"))
    cache = KVCache(SPEC, "cpu", "ortvalue")
    cache.copy_prefix(0, 1, 3)
    assert not cache.rows(0, 0, SPEC.slots)[0].any()
