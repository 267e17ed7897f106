"""What MatMulNBits' accuracy_level 4 does to the activations on the CPU, pinned: it quantizes them exactly as
llama.cpp's q8_0 does (blocks of 32 along K, scale max|x| / 127, round to nearest), so an int8 engine's
activation error is q8_0 x q8_0's and the int8 perplexity comparison with llama.cpp's q8_0 file
(docs/ACCURACY.md) compares like with like. Should a new ONNX Runtime round differently, this fails."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

K, N, BLOCK = 576, 128, 32


def _matmul_nbits_8bit(codes: np.ndarray, scales: np.ndarray, level: int) -> ort.InferenceSession:
    """y = x @ (codes * scales per block).T as one 8-bit MatMulNBits (zero point 128)."""
    node = helper.make_node("MatMulNBits", ["x", "w", "s", "zp"], ["y"], domain="com.microsoft", K=K, N=N, bits=8,
                            block_size=BLOCK, accuracy_level=level)
    weights = [numpy_helper.from_array((codes + 128).astype(np.uint8).reshape(N, K // BLOCK, BLOCK), "w"),
               numpy_helper.from_array(scales, "s"),
               numpy_helper.from_array(np.full(N * (K // BLOCK), 128, np.uint8), "zp")]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _q8_0(x: np.ndarray) -> np.ndarray:
    """llama.cpp's q8_0 round trip of activations: blocks of 32, scale max|x| / 127, round to nearest."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    scale = np.abs(blocks).max(-1, keepdims=True) / 127
    return (np.round(blocks / np.where(scale == 0, 1, scale)) * scale).reshape(x.shape)


@pytest.mark.parametrize("outliers", [False, True])
def test_level_4_activations_round_like_q8_0(outliers):
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, (N, K))
    scales = (rng.random((N, K // BLOCK)) * 0.01 + 0.001).astype(np.float32)
    weight = (codes.reshape(N, K // BLOCK, BLOCK) * scales[..., None].astype(np.float64)).reshape(N, K)
    x = rng.standard_normal((8, K)) * (np.where(rng.random(K) < 0.01, 30.0, 1.0) if outliers else 1.0)
    x = x.astype(np.float32)
    exact = x.astype(np.float64) @ weight.T
    level4 = _matmul_nbits_8bit(codes, scales, 4).run(None, {"x": x})[0]
    q8_0 = _q8_0(x.astype(np.float64)) @ weight.T
    error, q8_0_error = level4 - exact, q8_0 - exact
    assert np.sqrt((error ** 2).mean()) > 1e-3  # activations really are quantized at level 4
    # the same rounding: level 4 lands on q8_0's result, its distance from it far below q8_0's own error
    assert np.abs(level4 - q8_0).max() < 1e-3 * np.abs(q8_0_error).max() + 1e-4 * np.abs(exact).max()
    level0 = _matmul_nbits_8bit(codes, scales, 0).run(None, {"x": x})[0]
    np.testing.assert_allclose(level0, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())  # float activations
