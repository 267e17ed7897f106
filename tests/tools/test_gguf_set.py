"""tools/bench/gguf_set.py without llama.cpp: the names it accepts, the table it prints from measured rows."""
from __future__ import annotations

import click
import pytest

from tools.bench.gguf_set import MODELS, TYPES, _names, markdown


def _measured(ours: float, peer: float) -> dict:
    return {"ours": {"median": ours}, "llama.cpp": {"median": peer}}


def test_unknown_model_or_type_is_refused_with_the_choices():
    assert _names("smollm2, qwen3", MODELS, "model") == ["smollm2", "qwen3"]
    with pytest.raises(click.BadParameter, match="Q4_0, Q4_1, Q4_K_M, Q5_K_M, Q6_K, Q8_0"):
        _names("Q4_K_S", TYPES, "type")


def test_table_has_one_row_per_file_with_ratios_and_perplexity_where_scored():
    results = {"ours": {}, "llama.cpp": {}}
    rates = {"decode_b1": (60.0, 50.0), "decode_b8": (240.0, 120.0), "prefill_512": (300.0, 200.0)}
    for key, (ours, peer) in rates.items():
        for side, value in _measured(ours, peer).items():
            results[side][key] = value
    scored = {"model": "smollm2", "type": "Q4_1", "tensors": "Q4_1 210, Q8_0 1", "results": results,
              "perplexity": {"transformers": 15.0, "ours": 15.2, "llama.cpp": 15.1},
              "top1": {"ours": 0.95, "llama.cpp": 0.96}, "vs_llama_cpp": 0.0066, "vs_llama_cpp_95": 0.005}
    raced = {**scored, "model": "qwen3", "type": "Q4_K_M"}
    for key in ("perplexity", "top1", "vs_llama_cpp", "vs_llama_cpp_95"):
        del raced[key]
    lines = markdown([scored, raced]).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| file |")
    assert "| smollm2 Q4_1 | Q4_1 210, Q8_0 1 | 60.0 / 50.0 = **1.20x** | 240.0 / 120.0 = **2.00x** |" in lines[2]
    assert "**+0.66%** ± 0.50% (0.950 / 0.960)" in lines[2]
    assert lines[3].endswith("| - |")
