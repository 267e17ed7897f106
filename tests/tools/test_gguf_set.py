"""tools/bench/gguf_set.py without llama.cpp: the names it accepts, the table it prints from measured rows."""
from __future__ import annotations

from pathlib import Path

import click
import pytest

from tools.bench.gguf_set import MODELS, TYPES, _names, markdown, recipe_text


def _measured(ours: float, peer: float) -> dict:
    return {"ours": {"median": ours}, "llama.cpp": {"median": peer}}


def test_unknown_model_or_type_is_refused_with_the_choices():
    assert _names("smollm2, qwen3", MODELS, "model") == ["smollm2", "qwen3"]
    assert _names("IQ4_XS", TYPES, "type") == ["IQ4_XS"]
    with pytest.raises(click.BadParameter, match="Q4_0, Q4_1, Q4_K_M, Q5_K_M, Q6_K, Q8_0, IQ4_XS"):
        _names("Q4_K_S", TYPES, "type")


def test_table_has_one_row_per_file_with_ratios_and_perplexity_where_scored():
    results = {"ours": {}, "llama.cpp": {}}
    rates = {"decode_b1": (60.0, 50.0), "decode_b8": (240.0, 120.0), "prefill_512": (300.0, 200.0)}
    for key, (ours, peer) in rates.items():
        for side, value in _measured(ours, peer).items():
            results[side][key] = value
    scored = {"model": "smollm2", "type": "Q4_1", "tensors": "Q4_1 210, Q8_0 1", "results": results,
              "perplexity": {"transformers": 15.0, "ours": 15.2, "llama.cpp": 15.1},
              "top1": {"ours": 0.95, "llama.cpp": 0.96}, "vs_llama_cpp": 0.0066, "vs_llama_cpp_95": 0.005,
              "top1_vs_llama_cpp": -0.01, "top1_vs_llama_cpp_se": 0.004, "greedy_16": 16,
              "load_average_before": [0.4, 0.5, 0.6], "load_average": [1.26, 0.7, 0.6], "scored_tokens": 4088}
    raced = {**scored, "model": "qwen3", "type": "Q4_K_M", "load_average_before": None}
    for key in ("perplexity", "top1", "vs_llama_cpp", "vs_llama_cpp_95", "top1_vs_llama_cpp", "top1_vs_llama_cpp_se",
                "scored_tokens"):
        del raced[key]
    lines = markdown([scored, raced]).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| file |")
    assert "| smollm2 Q4_1 | Q4_1 210, Q8_0 1 | 60.0 / 50.0 = **1.20x** | 240.0 / 120.0 = **2.00x** |" in lines[2]
    assert ("| 16/16 | 15.200 / 15.100: **+0.66%** ± 0.50% (4088 tokens) | 0.9500 / 0.9600: **-0.0100** ± 0.0040 "
            "| 0.4 / 1.3 |") in lines[2]
    assert lines[3].endswith("| 16/16 | - | - | ? / 1.3 |")


def test_auto_engines_are_built_as_the_readme_recipe_with_their_float_reference_check(tmp_path):
    gguf, out = tmp_path / "smollm2-Q4_0.gguf", tmp_path / "smollm2-Q4_0.engine"
    auto = recipe_text(gguf, out, "smollm2", "auto")
    readme = Path("build_recipes/smollm2_cpu.yaml").read_text().splitlines()
    quantization = next(line for line in readme if line.startswith("quantization:"))
    verify = next(line for line in readme if line.startswith("verify:"))
    assert "accuracy_level: auto" in quantization and "verify: {enabled: on" in verify
    assert quantization in auto.splitlines() and verify in auto.splitlines()  # the recipe's, as written
    random_auto = recipe_text(gguf, out, "qwen3", "auto").splitlines()
    assert quantization in random_auto and "verify: {enabled: on}" in random_auto
    fixed = recipe_text(gguf, out, "qwen3", "{default: 4}")
    assert "accuracy_level: {default: 4}}" in fixed and "verify: {enabled: off}" in fixed



def test_untimed_work_runs_in_an_idle_child_and_the_run_keeps_its_priority(monkeypatch):
    from tools.bench import gguf_set

    ran = []
    monkeypatch.setattr(gguf_set, "_run", ran.append)
    gguf_set.idle_call("quantize", "a.gguf", "b.gguf", "Q4_0", "2")
    [cmd] = ran
    assert cmd[:6] == ["chrt", "-i", "0", "nice", "-n", "19"] and cmd[-4:] == ["a.gguf", "b.gguf", "Q4_0", "2"]
    assert "gguf_set.quantize(*sys.argv[1:])" in cmd[-5]
