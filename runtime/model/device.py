"""Where an engine runs: the device it runs on (its build target unless asked otherwise, checked
against its dtype) and the ONNX Runtime execution providers that device needs."""
from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.manifest.load import EngineError, Manifest

if TYPE_CHECKING:
    import onnxruntime as ort

# Inputs a kernel reads on the host (GroupQueryAttention's total_sequence_length, the sampling head's TopK k):
# bound from host memory. Every other input lives on the session's device, bound once by address and written in
# place each step: ONNX Runtime copies a host input to the device once, when it is bound, so a host array written
# later never reaches the GPU.
HOST_READ = ("total_sequence_length", "top_k")
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


DEVICE_DTYPES = {"cpu": ("float32", "float16"), "cuda": ("float16", "bfloat16")}


def run_device(manifest: Manifest, device: str | None) -> str:
    """The device to run on: `device`, else the one the engine was built for; an EngineError when the
    engine's dtype cannot run there (float32/float16 on CPU, float16/bfloat16 on CUDA)."""
    device = device or manifest.target.device
    dtype = manifest.kv_cache.dtype
    if device not in DEVICE_DTYPES:
        raise EngineError(f"device {device!r} is not one of {sorted(DEVICE_DTYPES)}")
    if dtype not in DEVICE_DTYPES[device]:
        raise EngineError(f"a {dtype} engine cannot run on {device} (it runs {', '.join(DEVICE_DTYPES[device])}); "
                          f"choose another device or rebuild with --set target.dtype=...")
    return device


def providers(manifest: Manifest, device: str | None = None) -> list[str]:
    """The ONNX Runtime execution providers for `device` (default: the engine's target device), or an
    EngineError that says what the engine needs and what this installation has."""
    import onnxruntime as ort

    device = device or manifest.target.device
    wanted, available = PROVIDERS[device], ort.get_available_providers()
    if wanted not in available:
        both = "" if device == "cpu" or not _shadowed() else (
            "; both onnxruntime and onnxruntime-gpu are installed and shadow each other: pip uninstall -y "
            "onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu")
        raise EngineError(f"device {device!r} needs {wanted}, which this onnxruntime {ort.__version__} lacks "
                          f"(it has {available}): {cuda_advice()}{both}")
    return [wanted] + (["CPUExecutionProvider"] if wanted != "CPUExecutionProvider" else [])


def cuda_advice() -> str:
    """What is missing for CUDA on this machine: the GPU driver itself, or only onnxruntime-gpu."""
    from pathlib import Path

    if not Path("/proc/driver/nvidia").exists():
        return ("this machine has no NVIDIA driver (no /proc/driver/nvidia), so no CUDA: run on the CPU (an engine "
                "built for cuda: rebuild it with engine-build --set target.device=cpu), or use a machine with an "
                "NVIDIA GPU (docs/GPU.md)")
    return ("this machine has an NVIDIA driver but not onnxruntime-gpu: install it into a fresh virtualenv with "
            "pip install -e \".[gpu]\" (onnxruntime and onnxruntime-gpu clash in one environment; docs/GPU.md)")


def _shadowed() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return bool(version("onnxruntime") and version("onnxruntime-gpu"))
    except PackageNotFoundError:
        return False


def open_session(path, options, providers: list) -> ort.InferenceSession:
    """An InferenceSession (of a model file, or its bytes) on `providers` that really runs on the first of them. ONNX Runtime lists CUDA among
    its available providers even when the CUDA provider library cannot load (cuDNN or cuBLAS missing) and then
    runs the session on CPU with only a log line: an EngineError here names the provider that was asked for,
    the ones the session got and what to install."""
    import onnxruntime as ort

    wanted = providers[0] if isinstance(providers[0], str) else providers[0][0]
    if wanted == "CUDAExecutionProvider":
        preload_cuda()
    session = ort.InferenceSession(path if isinstance(path, bytes) else str(path), options, providers=providers)
    got = session.get_providers()
    if not got or got[0] != wanted:
        where = "a model" if isinstance(path, bytes) else path
        raise EngineError(f"{where}: asked ONNX Runtime {ort.__version__} for {wanted} and the session runs on "
                          f"{got}: the {wanted} library did not load (its log above says why). For CUDA: "
                          f"onnxruntime-gpu {CUDA_BUILD} needs CUDA 13 and cuDNN 9 libraries "
                          f"(pip install \".[gpu]\" brings them; see docs/GPU.md)")
    return session


CUDA_BUILD = "1.31.x"  # pyproject's gpu extra: onnxruntime-gpu built for CUDA 13 (keep the two in step)


def preload_cuda() -> None:
    """Load the CUDA and cuDNN libraries that onnxruntime-gpu needs from the nvidia-* pip packages (or a
    compatible torch's) before a CUDA session opens, where this onnxruntime has `preload_dlls` (1.21+)."""
    import onnxruntime as ort

    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        preload()
