"""Ahead-of-time engine builder: Hugging Face checkpoint -> IR -> passes -> ONNX engine."""
__version__ = "0.1.0"
