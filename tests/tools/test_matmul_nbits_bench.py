"""tools/bench/matmul_nbits.py: the graph it times computes what the builder's quantized weights mean, and its
command line refuses a malformed config by name."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from builder.quant.schemes import dequantize, quantize
from tools.bench import matmul_nbits


@pytest.mark.parametrize("config", ["4:32:0:sym", "4:32:0:asym", "8:16:0:sym"])
def test_timed_graph_is_the_quantized_matmul(config):
    bits, block, level, symmetric = matmul_nbits.parse_config(config)
    sess, nbytes = matmul_nbits.session(24, 80, bits, block, level, symmetric, copies=2, threads=1)
    rng = np.random.default_rng(0)  # the weights session() draws, in its order
    expected = [quantize(rng.standard_normal((24, 80)).astype(np.float32), bits, block, symmetric) for _ in range(2)]
    x = np.random.default_rng(3).standard_normal((3, 80)).astype(np.float32)
    for y, arrays in zip(sess.run(None, {"x": x}), expected):
        np.testing.assert_allclose(y, x @ dequantize(arrays, bits, block, 80).T, rtol=1e-4, atol=1e-4)
    assert nbytes == sum(a.q.nbytes + a.scales.nbytes + (0 if a.zero_points is None else a.zero_points.nbytes)
                         for a in expected)


def test_cli_sweeps_and_refuses_a_bad_config(monkeypatch):
    monkeypatch.setitem(matmul_nbits.SHAPES, "smollm2", ([(16, 64)], 2))
    result = CliRunner().invoke(matmul_nbits.main, ["--config", "4:32:4:sym", "--m", "1,2", "--runs", "2"])
    assert result.exit_code == 0, result.output
    assert [line.split(" M ")[0] for line in result.output.splitlines()] == ["smollm2 4:32:4:sym"] * 2
    bad = CliRunner().invoke(matmul_nbits.main, ["--config", "4:32:sym"])
    assert bad.exit_code == 2 and "give bits:block:accuracy_level:sym|asym" in bad.output
