"""The build-time check of a GGUF file's engine that rounds at run time (int8 activations): its reference is the
file's own weights in float, so the error left is the rounding. A max-|logit| bar refused SmolLM2's Q4_0 file
(9.35 against 0.15 x the largest logit, 4.85: one of 57 random-token positions, where the int8 activations meet
an outlier; the same engine at float activations is within 2.5e-3 and its prose perplexity within 0.04% of
llama.cpp's) while it let a wrong nibble order through. The bar is the median position's logit error relative to
the reference's spread (reference_check.relative_errors): a few stray positions pass, a wrong weight fails."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from builder.recipe import Verify, load_recipe
from builder.reference_check import _bar, relative_errors

RECIPE = "build_recipes/smollm2_cpu.yaml"  # the README recipe's verify settings


def _logits(rng, positions: int = 57, vocab: int = 500) -> np.ndarray:
    return (3.0 * rng.standard_normal((positions, vocab))).astype(np.float32)


def test_relative_error_is_the_rms_error_over_the_reference_spread_and_scale_free():
    rng = np.random.default_rng(0)
    theirs = _logits(rng)
    noise = 0.3 * rng.standard_normal(theirs.shape)  # RMS 0.3 against a spread of 3: 0.1 at every position
    errors = relative_errors([theirs + noise], [theirs])
    assert errors.shape == (57,) and np.allclose(errors, 0.1, atol=0.02)
    np.testing.assert_allclose(relative_errors([10 * (theirs + noise)], [10 * theirs]), errors, rtol=1e-6)
    assert np.all(relative_errors([theirs], [theirs]) == 0)
    unrelated = relative_errors([_logits(rng)], [theirs])  # an engine that has nothing to do with its reference
    assert np.all(unrelated > 1.0)


def test_a_few_far_positions_pass_and_an_error_at_every_position_fails():
    """SmolLM2 Q4_0's shape of error: 0.07 typically, one position at 1.17 (max |error| ~3x the spread), passes
    the README recipe's 0.15; a wrong weight's error, 0.3 at every position, does not."""
    options = load_recipe(RECIPE).verify
    rng = np.random.default_rng(1)
    theirs = _logits(rng)
    ours = theirs + 0.07 * 3.0 * rng.standard_normal(theirs.shape)
    ours[1] = theirs[1] + 1.17 * 3.0 * rng.standard_normal(theirs.shape[1])
    error = float(np.abs(ours - theirs).max())
    rounded = "int8 activations (accuracy_level 4)"
    bar = _bar([ours], [theirs], error, options, "float32", rounded, gguf=True)
    assert bar.measured < 0.1 and bar.measured <= bar.tolerance == options.quantized_tolerance == 0.15
    assert bar.spread.max() > 1.0 and "median position" in bar.why
    old = _bar([ours], [theirs], error, options, "float32", rounded, gguf=False)  # a non-GGUF engine's bar
    assert old.measured > old.tolerance  # the max-|logit| bar refuses the same logits
    wrong = theirs + 0.3 * 3.0 * rng.standard_normal(theirs.shape)
    bar = _bar([wrong], [theirs], float(np.abs(wrong - theirs).max()), options, "float32", rounded, gguf=True)
    assert bar.measured > bar.tolerance


def test_an_engine_that_does_not_round_keeps_the_exact_bar():
    theirs = _logits(np.random.default_rng(2))
    bar = _bar([theirs + 1e-4], [theirs], 1e-4, Verify(), "float32", "", gguf=True)
    assert bar.spread is None and bar.tolerance == Verify().tolerance and bar.measured == 1e-4


def _build(tmp_path, unpack=None, monkeypatch=None):
    """A tiny Q4_0 llama file built with the README recipe's verify settings at int8 activations; `unpack`
    replaces the Q4_0 repack (a broken import: the reference, transformers reading the file, stays right)."""
    pytest.importorskip("gguf")
    from builder.build import build_engine
    from builder.gguf import repack
    from tests.builder.gguf_files import write_llama

    good = repack.BLOCK_TYPES["Q4_0"]
    if unpack is not None:
        monkeypatch.setitem(repack.BLOCK_TYPES, "Q4_0", dataclasses.replace(good, unpack=lambda b: unpack(good, b)))
    path = write_llama(tmp_path / "m.gguf", dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), "Q4_0"),
                       hidden=256, inter=512, heads=4, kv_heads=2)
    lines: list[str] = []
    recipe = load_recipe(RECIPE, overrides=[f"model={path}", f"out={tmp_path / 'engine'}", "limits.max_seq_len=64",
                                            "limits.max_batch_size=1", "quantization.accuracy_level=4"])
    engine = build_engine(recipe, tmp_path / "engine", log=lines.append)
    return engine, [line for line in lines if line.startswith("verify:")]


def test_a_right_gguf_import_passes_on_the_median_relative_error(tmp_path):
    import json

    engine, (first, verdict) = _build(tmp_path)
    report = json.loads((engine / "manifest.json").read_text())["verification"]
    assert report["passed"] and report["tolerance_on"] == "relative_error_median" and report["tolerance"] == 0.15
    assert 0 < report["relative_error_median"] < 0.03 <= 0.15, report  # int8 activations: ~0.005 on this file
    assert "relative to the reference's spread" in first and "median position" in first and verdict == "verify: ok"


def _scale(good, raw, factor=1.5):
    blocks = good.unpack(raw)
    return blocks._replace(scales=blocks.scales * np.float32(factor))


def _swap_halves(good, raw):  # each block's high and low nibbles exchanged: codes in the wrong order
    blocks = good.unpack(raw)
    codes = blocks.codes.reshape(len(blocks.codes), 2, -1)[:, ::-1].reshape(len(blocks.codes), -1)
    return blocks._replace(codes=np.ascontiguousarray(codes))


@pytest.mark.parametrize("unpack", [_scale, _swap_halves], ids=["scale_x1.5", "nibbles_swapped"])
def test_a_broken_gguf_import_fails(unpack, tmp_path, monkeypatch):
    """Measured on this file: the right import 0.005, scales x 1.5 0.36, nibbles swapped 0.29 (the max-|logit| bar
    at 0.15 passed the swap: 0.129 x the largest logit)."""
    from builder.build import VerificationFailed

    with pytest.raises(VerificationFailed, match=r"median logit error relative to the reference's spread 0\.[2-9]"):
        _build(tmp_path, unpack, monkeypatch)
    assert not (tmp_path / "engine").exists()
