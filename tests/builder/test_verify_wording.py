"""engine-build's verification lines say what was compared with what and where the tolerance comes from (#23: a
quantized build printed an unexplained tolerance): a float engine against transformers with verify.tolerance; a
quantized one against transformers running its own dequantized weights, with a tolerance scaled by the largest
logit because the engine rounds activations at run time; then, separately, the cost against the float model."""
from __future__ import annotations

import pytest

from builder.build import build_engine
from builder.recipe import load_recipe


def _log_of(checkpoint, tmp_path, *overrides: str) -> list[str]:
    lines: list[str] = []
    recipe = load_recipe(base={"model": str(checkpoint)},
                         overrides=["limits.max_seq_len=64", "verify.enabled=on", "verify.min_greedy_agreement=0",
                                    *overrides])
    build_engine(recipe, tmp_path / "engine", log=lines.append)
    return [line for line in lines if line.startswith("verify:")]


def test_a_float_build_says_its_reference_and_tolerance(tiny_checkpoint, tmp_path):
    first, verdict = _log_of(tiny_checkpoint, tmp_path)
    assert first.startswith("verify: engine vs transformers: max |logit error| ")
    assert "(tolerance 0.001 = verify.tolerance 0.001)" in first and verdict == "verify: ok"


def test_a_quantized_build_explains_its_tolerance_and_the_float_comparison(tiny_checkpoint, tmp_path):
    first, float_line, verdict = _log_of(tiny_checkpoint, tmp_path, "quantization.mode=int8")
    assert first.startswith("verify: engine vs transformers running the engine's own dequantized weights: ")
    assert ("= verify.quantized_tolerance 0.1 x the largest |logit| " in first
            and "the engine rounds int8 activations (accuracy_level 4) at run time, the reference does not" in first)
    assert float_line.startswith("verify: engine vs the float model (what quantization costs, not an error bound)")
    assert float_line.endswith("(minimum verify.min_greedy_agreement 0.0)") and verdict == "verify: ok"


def test_a_gguf_build_says_its_one_comparison_once(tmp_path):
    """A GGUF file's own integers: the reference (transformers from the same file) is the float model itself, so
    the comparison is one line, its minimum greedy agreement in it, not the same numbers twice (issue 48)."""
    pytest.importorskip("gguf")
    from tests.builder.gguf_files import write_llama

    model = write_llama(tmp_path / "m.gguf", dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), "Q4_1"),
                        hidden=256, inter=512, heads=4, kv_heads=2)
    first, verdict = _log_of(model, tmp_path)
    assert first.startswith("verify: engine vs transformers: max |logit error| ")
    assert first.endswith("(minimum verify.min_greedy_agreement 0.0)") and verdict == "verify: ok"
