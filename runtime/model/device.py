"""Where an engine runs: the device it runs on (its build target unless asked otherwise, checked
against its dtype) and the ONNX Runtime execution providers that device needs."""
from __future__ import annotations

from runtime.manifest.load import EngineError, Manifest

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


DEVICE_DTYPES = {"cpu": ("float32", "float16"), "cuda": ("float16", "bfloat16")}


def run_device(manifest: Manifest, device: str | None) -> str:
    """The device to run on: `device`, else the one the engine was built for; an EngineError when the
    engine's dtype cannot run there (float32/float16 on CPU, float16/bfloat16 on CUDA)."""
    device = device or manifest.target.device
    dtype = manifest.kv_cache.dtype
    if manifest.target.attention != "gqa":
        raise EngineError(f"this engine was built with target.attention {manifest.target.attention} (PagedAttention "
                          f"over a KV block pool, CUDA only); LLM runs GroupQueryAttention engines so far: rebuild with "
                          f"target.attention gqa (a paged engine is driven step by step with runtime/model/paged_inputs.py)")
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
                          f"(it has {available}): install onnxruntime-gpu (pip install \".[gpu]\") on a machine "
                          f"with an NVIDIA GPU and CUDA driver, or load with device='cpu' / rebuild with "
                          f"--set target.device=cpu{both}")
    return [wanted] + (["CPUExecutionProvider"] if wanted != "CPUExecutionProvider" else [])


def _shadowed() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return bool(version("onnxruntime") and version("onnxruntime-gpu"))
    except PackageNotFoundError:
        return False
