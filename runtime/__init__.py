"""The runtime: numpy + onnxruntime + tokenizers. ONNX Runtime comes from one of this package's extras
(`cpu`, or `gpu` for onnxruntime-gpu), never both: they install the same module and shadow each other.
Nothing is imported here: the CLIs install their Ctrl-C handling before the heavy imports (runtime.engine)."""
