"""Running the ONNX graph: runner base and single-process model runner, KV cache buffers, ONNX Runtime sessions and device choice."""
