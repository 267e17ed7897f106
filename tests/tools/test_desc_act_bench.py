"""tools/bench/desc_act: its three lowerings of a desc_act weight compute what they claim (the Gather one and
the g_idx one exactly, the plain one the unpermuted weight), so its timings compare like with like."""
from __future__ import annotations

import numpy as np

from tools.bench.desc_act import sessions


def test_gather_and_g_idx_lowerings_are_exact_and_plain_is_not():
    built, weight = sessions(256, 32, 0, np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    reference = x @ weight.T
    for way in ("gather", "g_idx"):
        np.testing.assert_allclose(built[way].run(None, {"x": x})[0], reference, rtol=1e-4, atol=1e-4, err_msg=way)
    assert np.abs(built["plain"].run(None, {"x": x})[0] - reference).max() > 0.1 * np.abs(reference).max()
