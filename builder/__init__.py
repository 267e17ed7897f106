"""Ahead-of-time engine builder: Hugging Face checkpoint -> IR -> passes -> ONNX engine."""
from runtime.manifest.version import __version__  # noqa: F401  (one owner: the engine-format contract)
