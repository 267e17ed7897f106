"""The static KV cache: one key and one value buffer per layer, allocated once from the engine's
KVCacheSpec and updated in place by the attention kernel. It owns only buffers: allocation, views and
bindings over rows of slots, and copying a prefix between slots. Which sequence holds which slot, and
what a slot holds, is the scheduler's slot table (runtime/batching/slot_table.py).

Where the buffers live follows the session: numpy arrays for the CPU fast path (backend "numpy"), or
buffers on the engine's device (backend "ortvalue": on CUDA cudaMalloc'd outside ONNX Runtime's arena,
runtime/model/cuda_memory.py; on CPU, when asked, OrtValues, so CI runs the device path). A call over rows
[a, b) binds them by pointer at base + a * row bytes; a prefix copy is complete before the next call."""
from __future__ import annotations

import ctypes
import mmap
from typing import Iterable

import numpy as np
import onnxruntime as ort

from runtime.manifest.arith import ceil_div
from runtime.config import KV_BACKENDS
from runtime.manifest.kv_spec import ITEM_BYTES, KVCacheSpec
from runtime.manifest.types import DEVICES
from runtime.model.cuda_memory import DeviceBuffer, copy_2d, synchronize

ONNX_TYPES = {"float32": 1, "float16": 10, "bfloat16": 16, "int8": 3}  # onnx.TensorProto element types


class KVCache:
    """Buffers `[slots, kv_heads, max_seq_len, head_dim]` per layer, of the spec's storage dtype (int8
    codes for an int8 KV engine: half the bytes of float16).

    `device` "cpu" or "cuda"; `backend` "numpy" (CPU only, the default there) or "ortvalue" (the
    default on CUDA; bfloat16 needs it, numpy has no bfloat16). `device_id`: which GPU holds an ortvalue
    cache's buffers (a tensor-parallel rank's own; 0 otherwise)."""

    def __init__(self, spec: KVCacheSpec, device: str = "cpu", backend: str | None = None, device_id: int = 0):
        backend = backend or ("numpy" if device == "cpu" and spec.storage_dtype != "bfloat16" else "ortvalue")
        if device not in DEVICES or backend not in KV_BACKENDS:
            raise ValueError(f"KV cache device {device!r} / backend {backend!r}: allowed devices {DEVICES}, "
                             f"backends {KV_BACKENDS}")
        if backend == "numpy" and (device != "cpu" or spec.storage_dtype == "bfloat16"):
            raise ValueError(f"a numpy KV cache holds only CPU float32/float16 buffers, not {device} "
                             f"{spec.dtype}: use backend 'ortvalue'")
        self.spec, self.device, self.backend = spec, device, backend
        self.device_id = device_id if device == "cuda" else 0
        self.row_bytes = spec.kv_heads * spec.max_seq_len * spec.head_dim * ITEM_BYTES[spec.storage_dtype]
        if backend == "numpy":
            self._maps: list[mmap.mmap] = []
            self.keys = [self._lazy_buffer() for _ in range(spec.num_layers)]
            self.values = [self._lazy_buffer() for _ in range(spec.num_layers)]
        else:
            self.keys = [self._device_buffer() for _ in range(spec.num_layers)]
            self.values = [self._device_buffer() for _ in range(spec.num_layers)]
        self._views: dict[tuple[int, int], list[tuple[ort.OrtValue, ort.OrtValue]]] = {}

    def _lazy_buffer(self) -> np.ndarray:
        """A zeroed [slots, kv_heads, max_seq_len, head_dim] host buffer that is address space only: an
        anonymous mapping whose pages the OS backs on first touch, in 4 KB pages (transparent huge pages
        would fault in 2 MB per head row on the first token), so resident memory follows the tokens written."""
        spec = self.spec
        mapping = mmap.mmap(-1, spec.slots * self.row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            mapping.madvise(mmap.MADV_NOHUGEPAGE)
        self._maps.append(mapping)
        return np.frombuffer(mapping, spec.numpy_dtype()).reshape(spec.buffer_shape)

    def release_row(self, slot: int, start: int = 0) -> None:
        """Hand the pages of row `slot` from token `start` on back to the OS (numpy backend; they read as zeros
        when touched again): a finished, preempted or evicted sequence's KV stops counting toward resident
        memory. Pages that straddle a neighbouring row, or tokens before `start`, are kept."""
        if self.backend != "numpy":
            return
        base, pitch = slot * self.row_bytes, self.row_bytes // self.spec.kv_heads  # one head's [max_seq_len, head_dim]
        ranges = [(base, base + self.row_bytes)] if start == 0 else \
            [(base + h * pitch + start * pitch // self.spec.max_seq_len, base + (h + 1) * pitch)
             for h in range(self.spec.kv_heads)]
        page = mmap.PAGESIZE
        for lo, hi in ranges:
            lo, hi = ceil_div(lo, page) * page, hi // page * page
            for mapping in self._maps if hi > lo else ():
                mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def resident_bytes(self) -> int:
        """Bytes of the KV buffers resident in memory now (numpy backend; `mincore` page counts)."""
        if self.backend != "numpy":
            return self.spec.bytes
        return sum(_resident(m) for m in self._maps)

    def _device_buffer(self) -> ort.OrtValue | DeviceBuffer:
        """A zeroed [slots, kv_heads, max_seq_len, head_dim] buffer on the device (`device_buffer`)."""
        return device_buffer(self.spec.buffer_shape, self.spec.storage_dtype, self.device, self.device_id)

    def copy_prefix(self, src: int, dst: int, tokens: int) -> None:
        """KV of the first `tokens` positions of slot `src` into slot `dst`, on the device."""
        if self.backend == "numpy":
            for k, v in zip(self.keys, self.values):
                k[dst, :, :tokens] = k[src, :, :tokens]
                v[dst, :, :tokens] = v[src, :, :tokens]
            return
        pitch = self.row_bytes // self.spec.kv_heads  # one head's [max_seq_len, head_dim]
        width = tokens * self.spec.head_dim * ITEM_BYTES[self.spec.storage_dtype]
        for buffer in self.keys + self.values:
            base = buffer.data_ptr()
            copy_2d(self.device, base + dst * self.row_bytes, base + src * self.row_bytes, pitch, width,
                    self.spec.kv_heads)
        synchronize(self.device, self.device_id)  # before ONNX Runtime's next call reads slot `dst`

    def row_pointers(self, layer: int, start: int) -> tuple[int, int]:
        """Device addresses of row `start` of one layer's key and value buffers (ortvalue backend)."""
        offset = start * self.row_bytes
        return self.keys[layer].data_ptr() + offset, self.values[layer].data_ptr() + offset

    def bind(self, binding: ort.IOBinding, start: int, stop: int, layers: Iterable[int] | None = None) -> None:
        """Bind rows [start, stop) of every layer (or of `layers` only: a tensor-parallel segment's) as
        past_key/value_i and present_key/value_i, one memory."""
        layers = range(self.spec.num_layers) if layers is None else layers
        if self.backend == "numpy":
            views = self.views(start, stop)
            for layer in layers:
                for kind, value in zip(("key", "value"), views[layer]):
                    binding.bind_ortvalue_input(f"past_{kind}_{layer}", value)
                    binding.bind_ortvalue_output(f"present_{kind}_{layer}", value)
            return
        shape = [stop - start] + list(self.spec.buffer_shape[1:])
        element = ONNX_TYPES[self.spec.storage_dtype]
        for layer in layers:
            for kind, pointer in zip(("key", "value"), self.row_pointers(layer, start)):
                binding.bind_input(f"past_{kind}_{layer}", self.device, self.device_id, element, shape, pointer)
                binding.bind_output(f"present_{kind}_{layer}", self.device, self.device_id, element, shape, pointer)

    def rows(self, layer: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """A host copy of rows [start, stop) of one layer's key and value (float32/float16, or int8 codes; for tests)."""
        if self.backend == "numpy":
            return self.keys[layer][start:stop].copy(), self.values[layer][start:stop].copy()
        return tuple(buffer.numpy()[start:stop] for buffer in (self.keys[layer], self.values[layer]))

    def views(self, start: int, stop: int) -> list[tuple[ort.OrtValue, ort.OrtValue]]:
        """OrtValues over rows [start, stop) of every layer's numpy buffers, sharing their memory."""
        key = (start, stop)
        if key not in self._views:
            self._views[key] = [(ort.OrtValue.ortvalue_from_numpy(k[start:stop]),
                                 ort.OrtValue.ortvalue_from_numpy(v[start:stop]))
                                for k, v in zip(self.keys, self.values)]
        return self._views[key]


def device_buffer(shape: tuple[int, ...], dtype: str, device: str, device_id: int = 0) -> ort.OrtValue | DeviceBuffer:
    """A zeroed KV buffer on the device: on CUDA from cudaMalloc, outside ONNX Runtime's arena (whose
    power-of-two growth can waste up to 2x); on CPU an OrtValue. `dtype`: the storage element type."""
    if device == "cuda":  # bfloat16 has no numpy type: its bits are what DeviceBuffer sizes
        return DeviceBuffer(shape, np.uint16 if dtype == "bfloat16" else np.dtype(dtype), device_id)
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), ONNX_TYPES[dtype], device, device_id)
    ctypes.memset(value.data_ptr(), 0, int(np.prod(shape)) * ITEM_BYTES[dtype])
    return value


_LIBC = ctypes.CDLL(None, use_errno=True)


def _resident(mapping: mmap.mmap) -> int:
    """Resident bytes of one mapping, from mincore's per-page flags."""
    pages = ceil_div(len(mapping), mmap.PAGESIZE)
    flags = (ctypes.c_ubyte * pages)()
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    if _LIBC.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(mapping)), flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed on the KV buffer")
    return int(np.count_nonzero(np.frombuffer(flags, np.uint8) & 1)) * mmap.PAGESIZE

