"""tools.bench.engine_variants: the exact variants give the built engine's logits (issue 47's measurements rest on
it): q / k / v of a Qwen3 GGUF (kept apart for their norms) as one MatMulNBits, one minimum term and a Split, and
block-32 weights re-blocked at 16 (at float activations, where the block changes no rounding)."""
from __future__ import annotations

import numpy as np
import pytest

from tools.bench.engine_variants import Rewrite, block16, joint_linears, level1, write

pytest.importorskip("gguf")


def _logits(engine):
    from builder.reference_check import engine_logits

    rng = np.random.default_rng(0)
    return engine_logits(engine, [rng.integers(0, 250, 13).tolist()])[0]


def _variant(engine, out, *rewrites):
    r = Rewrite(engine)
    for rewrite, kinds in rewrites:
        rewrite(r, kinds)
    write(r, out)
    return out, r


@pytest.mark.e2e  # ~15 s quiet, 45 s on a loaded machine: a tiny Qwen3 GGUF built
def test_exact_variants_give_the_engines_logits(tmp_path, monkeypatch):
    from tests.builder.gguf_files import write_llama
    from tests.builder.test_gguf import _build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    types = {**dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), "Q4_K"), "embed": "Q8_0"}
    model = write_llama(tmp_path / "m.gguf", types, hidden=256, inter=512, heads=2, kv_heads=1, arch="qwen3")
    _build(model, tmp_path / "engine", **{"quantization.accuracy_level": 1})
    base = _logits(tmp_path / "engine")

    joint, r = _variant(tmp_path / "engine", tmp_path / "joint", (joint_linears, []))
    assert sum(n.op_type == "Split" and n.output[0].startswith("q") for n in r.graph.node) >= 1
    np.testing.assert_allclose(_logits(joint), base, rtol=1e-5, atol=1e-4 * np.abs(base).max())

    reblocked, r = _variant(tmp_path / "engine", tmp_path / "block16", (block16, []))
    blocks = {a.i for n in r.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}
    assert blocks == {16}
    np.testing.assert_allclose(_logits(reblocked), base, rtol=1e-5, atol=1e-4 * np.abs(base).max())


def test_level1_sets_only_the_named_kinds(tmp_path, monkeypatch):
    from tests.builder.gguf_files import write_llama
    from tests.builder.test_accuracy_levels import SMOLLM2_TYPES
    from tests.builder.test_gguf import _build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = write_llama(tmp_path / "m.gguf", SMOLLM2_TYPES, hidden=256, inter=512, heads=4, kv_heads=2)
    _build(model, tmp_path / "engine", **{"quantization.accuracy_level": 4})
    _, r = _variant(tmp_path / "engine", tmp_path / "qkv1", (level1, ["qkv"]))
    levels = {n.input[1]: next(a.i for a in n.attribute if a.name == "accuracy_level")
              for n in r.graph.node if n.op_type == "MatMulNBits"}
    assert {w: lv for w, lv in levels.items() if lv == 1} == {w: 1 for w in levels if ".qkv." in w}
    assert len([w for w in levels if ".qkv." in w]) == 2
