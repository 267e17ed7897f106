"""The runtime: numpy + onnxruntime + tokenizers. ONNX Runtime comes from one of this package's extras
(`cpu`, or `gpu` for onnxruntime-gpu), never both: they install the same module and shadow each other.

The front door is `from runtime import LLM, AsyncLLM, SamplingParams, Speculation`. Those names are
imported lazily, on first use (module `__getattr__`): importing `runtime` itself imports nothing heavy, so
the CLIs install their Ctrl-C handling (runtime/interrupt.py) before ONNX Runtime and the tokenizer load."""
from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "runtime.engine",
    "AsyncLLM": "runtime.async_engine",
    "SamplingParams": "runtime.request.params",
    "Speculation": "runtime.speculation.speculator",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}; its public names are {__all__}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
