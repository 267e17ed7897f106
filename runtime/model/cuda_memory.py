"""Device memory the runtime manages itself, through cuda-python (`pip install ".[gpu]"`), and host memory
standing in for it on CPU (so CI runs the same code): buffers allocated outside ONNX Runtime's arena (its
power-of-two growth can waste up to 2x of a KV cache), 2D copies and memsets between them, each ordered
before ONNX Runtime's next call.

Ordering: cuda-python's cudaMemcpy2D and cudaMemset run on the legacy default stream and return before the
device finishes, and ONNX Runtime computes on a stream of its own (non-blocking, so not ordered after the
default one): every copy or memset here ends with a device synchronize, so the next call reads the new bytes.
ONNX Runtime's own work is finished when run_with_iobinding returns (it synchronizes its stream at run end)."""
from __future__ import annotations

import ctypes
import weakref

import numpy as np


def cudart():
    """cuda-python's runtime module, under its current or its older name."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError as error:
            raise RuntimeError("the CUDA KV cache allocates and copies its buffers with cuda-python, which is not "
                               "installed: pip install cuda-python (or this package's [gpu] extra)") from error
    return runtime


def _check(result: tuple, what: str) -> tuple:
    if int(result[0]) != 0:
        raise RuntimeError(f"{what} failed with CUDA error {result[0]}")
    return result


class DeviceBuffer:
    """`nbytes` zeroed bytes on GPU `device_id` from cudaMalloc (outside ONNX Runtime's arena), freed when the
    buffer is collected; `shape`/`dtype` say what it holds (for `numpy`, a host copy: tests)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, device_id: int = 0):
        self.shape, self.dtype, self.device_id = tuple(shape), np.dtype(dtype), device_id
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        runtime = cudart()
        _check(runtime.cudaSetDevice(device_id), "cudaSetDevice")
        self._pointer = int(_check(runtime.cudaMalloc(self.nbytes), f"cudaMalloc of {self.nbytes} bytes")[1])
        weakref.finalize(self, runtime.cudaFree, self._pointer)
        memset(self._pointer, self.nbytes, device_id)

    def data_ptr(self) -> int:
        return self._pointer

    def numpy(self) -> np.ndarray:
        host = np.empty(self.shape, self.dtype)
        runtime = cudart()
        _check(runtime.cudaMemcpy(host.ctypes.data, self._pointer, self.nbytes,
                                  runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
        return host


def copy_2d(device: str, dst: int, src: int, pitch: int, width: int, height: int) -> None:
    """Copy `height` runs of `width` bytes, `pitch` bytes apart, from src to dst; never through the host."""
    if device == "cpu":
        for row in range(height):
            ctypes.memmove(dst + row * pitch, src + row * pitch, width)
        return
    runtime = cudart()
    _check(runtime.cudaMemcpy2D(dst, pitch, src, pitch, width, height,
                                runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice), "cudaMemcpy2D")


def memset(pointer: int, count: int, device_id: int = 0) -> None:
    """Zero `count` device bytes, complete before this returns."""
    runtime = cudart()
    _check(runtime.cudaSetDevice(device_id), "cudaSetDevice")  # the buffer's GPU (a rank's own)
    _check(runtime.cudaMemset(pointer, 0, count), "cudaMemset")
    synchronize("cuda", device_id)


def synchronize(device: str, device_id: int = 0) -> None:
    """Wait until the device has finished the copies issued here (ONNX Runtime's stream is not ordered after
    the default one); nothing to wait for on CPU."""
    if device == "cpu":
        return
    runtime = cudart()
    _check(runtime.cudaSetDevice(device_id), "cudaSetDevice")
    _check(runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
