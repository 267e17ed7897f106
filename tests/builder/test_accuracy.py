"""What quantization costs on the committed trained checkpoint (checkpoints/trained/target), measured
by tools/accuracy.py on the first 4096 held-out tokens (16 windows of 256): every mode's engine
against the float32 engine, and the float32 engine against transformers.

Measured (onnxruntime 1.31.1, int4 group size 32, accuracy_level 4; perplexity 45.06 for float32 on
these tokens): int8 +0.04%, top-1 agreement 0.981, KL 0.0006; int4_rtn +0.65%, agreement 0.917, KL
0.0132; int4_awq +0.33%, agreement 0.911, KL 0.0133. The bounds:
- int8 within 1% and agreement >= 0.95: a 25x margin on perplexity; int8 weights barely move a model
  this size, nearly all of its error is level 4's int8 activations.
- int4 within 2% and agreement >= 0.85, while a layout error corrupts whole rows: swapping the two
  nibbles of each byte gives a perplexity in the thousands.
- int4_awq no worse than int4_rtn at the same group size, within the noise of 4096 tokens: KL(float32 ||
  int4) at most 5% above RTN's and perplexity at most 0.5% above. This 12-minute model has no
  salient activation channels for AWQ to protect: AWQ and RTN trade places by group size (groups of
  32: AWQ -0.3% perplexity, +1.4% KL; 64: +0.6%, +5.6%; 128: -0.05%, -3.6%), so a strict inequality
  would rank noise. A broken AWQ (scales not folded back exactly) moves both by far more. AWQ's scale
  search keeps s = 1 (plain RTN) for a site when no scale beats it on the calibration text.
docs/ACCURACY.md has the full table on 20000 tokens."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target"

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not (CHECKPOINT / "model.safetensors").is_file(),
                                 reason=f"no trained checkpoint at {CHECKPOINT} (python -m tools.checkpoints.train_tiny_model)")]


@pytest.fixture(scope="module")
def results() -> dict:
    from tools.accuracy import evaluate

    report = evaluate(CHECKPOINT, ["float32", "int8", "int4_rtn", "int4_awq", "float32+kv_int8"], group_size=32,
                      max_tokens=4096, window=256, log=lambda _: None)
    assert report["scored_tokens"] == 4096 and report["windows"] == 16
    return report["results"]


def relative(results: dict, mode: str) -> float:
    return results[mode]["perplexity"] / results["float32"]["perplexity"] - 1


def test_float32_engine_matches_transformers(results):
    assert abs(relative(results, "transformers")) < 1e-4
    assert results["transformers"]["top1_agreement"] == 1.0
    assert results["transformers"]["max_abs_logprob_diff_vs_float32_engine"] < 1e-3
    assert 5 < results["float32"]["perplexity"] < 200  # trained: far below uniform (4096) and unigram (683)


def test_int8_is_within_one_percent_of_float32(results):
    assert abs(relative(results, "int8")) < 0.01, results["int8"]
    assert results["int8"]["top1_agreement"] >= 0.95, results["int8"]
    assert results["int8"]["quantized_linears"] == 16 and results["int8"]["float_linears"] == ["lm_head"]


@pytest.mark.parametrize("mode", ["int4_rtn", "int4_awq"])
def test_int4_is_within_two_percent_of_float32(results, mode):
    assert relative(results, mode) < 0.02, results[mode]
    assert results[mode]["top1_agreement"] >= 0.85, results[mode]
    # every linear but lm_head
    assert results[mode]["quantized_linears"] == 16 and results[mode]["float_linears"] == ["lm_head"]


def test_int8_kv_cache_is_within_half_a_percent_of_float_kv(results):
    """Issue #29's target: int8 KV (static per-channel scales) <= +0.5% held-out perplexity vs float KV.
    Measured on 20000 tokens (docs/ACCURACY.md): +0.03%, top-1 agreement 0.987, KL 0.0003."""
    assert relative(results, "float32+kv_int8") <= 0.005, results["float32+kv_int8"]
    assert results["float32+kv_int8"]["top1_agreement"] >= 0.97, results["float32+kv_int8"]


def test_awq_is_no_worse_than_round_to_nearest(results):
    awq, rtn = results["int4_awq"], results["int4_rtn"]
    assert awq["kl_per_token"] <= 1.05 * rtn["kl_per_token"], results
    assert awq["perplexity"] <= 1.005 * rtn["perplexity"], results


def test_engines_shrink(results):
    """The quantized linears shrink ~4x (int8, one float32 scale per 32 weights) and ~6x (int4 in groups
    of 32: half a byte per weight plus a float32 scale per group); embeddings and lm_head stay float32."""
    c = json.loads((CHECKPOINT / "config.json").read_text())
    h, q = c["hidden_size"], c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    linear_bytes = 4 * c["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + 3 * h * c["intermediate_size"])
    sizes = {mode: results[mode]["size_bytes"] for mode in ("float32", "int8", "int4_rtn", "int4_awq")}
    # int8: blocks of 32 along K (K 192, 512: no padding): ideal 1 - (1 + 4/32) / 4 = 0.72
    assert sizes["float32"] - sizes["int8"] > 0.6 * linear_bytes, sizes
    for mode in ("int4_rtn", "int4_awq"):
        assert sizes["float32"] - sizes[mode] > 0.8 * linear_bytes, sizes  # ideal: 1 - (0.5 + 4/32) / 4 = 0.844


@pytest.mark.parametrize("recipe", ["trained_cpu", "trained_int8_cpu", "trained_int4_cpu"])
def test_shipped_trained_recipes_build_and_verify(recipe, tmp_path):
    """The recipes as shipped, with their verification (transformers, and for the quantized ones
    the float model's greedy picks at their min_greedy_agreement)."""
    from builder.build import build_engine
    from builder.recipe import load_recipe
    from runtime.manifest.load import load_manifest

    path = Path(__file__).resolve().parents[2] / "build_recipes" / f"{recipe}.yaml"
    options = load_recipe(path, overrides=[f"model={CHECKPOINT}"])
    manifest = load_manifest(build_engine(options, tmp_path / "engine", log=lambda _: None))
    assert manifest["verification"]["passed"]
    if recipe != "trained_cpu":
        record = manifest["quantization"]
        assert len(record["quantized"]) == 16 and list(record["skipped"]) == ["lm_head"]
        k = json.loads((CHECKPOINT / "config.json").read_text())["intermediate_size"]  # down_proj's K
        down = record["quantized"]["layers.0.down"]
        assert down["K"] == k and down.get("last_block_padding", 0) == (-k) % down["block_size"]


def test_paired_interval_and_comparisons():
    """The 95% interval of a perplexity change comes from the windows' paired loss differences."""
    import numpy as np

    from tools.accuracy import Stats, compare_pairs

    def stats(window_nll):
        return Stats(nll=sum(window_nll), tokens=10 * len(window_nll), window_nll=list(window_nll))

    base = stats([20.0, 22.0, 24.0, 26.0])
    shifted = stats([21.0, 23.0, 25.0, 27.0])  # every window 1 nat worse: a change with no spread
    noisy = stats([22.0, 21.0, 26.0, 25.0])
    assert shifted.interval(base) == 0.0
    assert noisy.interval(base) == pytest.approx(1.96 * np.std([2, -1, 2, -1], ddof=1) * 2 / 40)
    [pair] = compare_pairs({"a": base, "b": shifted}, ["a", "b"])
    assert pair["base"] == "a" and pair["perplexity_change"] == pytest.approx(np.exp(4 / 40) - 1)


def test_paired_top1_difference():
    """Top-1 agreement counted per window; the difference between two models and its standard error come from the
    windows' paired differences."""
    import numpy as np

    from tools.accuracy import Stats

    reference = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1]]))
    right, one_wrong = Stats(), Stats()
    for _ in range(3):  # three windows of two positions each add
        right.add(reference, np.zeros(4, int), reference, windows=2)
        one_wrong.add(reference[[1, 1, 2, 3]], np.zeros(4, int), reference, windows=2)  # position 0 disagrees
    assert right.window_agree == [2] * 6 and one_wrong.window_agree == [1, 2] * 3
    diff, se = one_wrong.top1_difference(right)
    assert diff == pytest.approx(-3 / 12)
    assert se == pytest.approx(np.std([-1, 0] * 3, ddof=1) * np.sqrt(6) / 12)


def test_rewriting_the_report_keeps_the_hand_written_sections(tmp_path):
    from tools.accuracy import KEPT, with_kept_sections

    old = tmp_path / "ACCURACY.md"
    assert with_kept_sections("# new table\n", old) == "# new table\n"
    old.write_text(f"# old table\n\n{KEPT}\n\n## Findings\ntext\n")
    assert with_kept_sections("# new table\n", old) == f"# new table\n\n{KEPT}\n\n## Findings\ntext\n"
