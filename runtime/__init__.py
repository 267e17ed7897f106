"""The runtime: numpy + onnxruntime + tokenizers. ONNX Runtime comes from one of this package's extras
(`cpu`, or `gpu` for onnxruntime-gpu), never both: they install the same module and shadow each other."""
try:
    import onnxruntime as _onnxruntime  # noqa: F401
except ImportError as _error:
    raise ImportError("the runtime needs ONNX Runtime, which is not installed: pip install \".[cpu]\" (or "
                      "onnxruntime) on a CPU machine, or pip install \".[gpu]\" (onnxruntime-gpu, without "
                      "onnxruntime) on a machine with an NVIDIA GPU") from _error
