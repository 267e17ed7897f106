"""tools/bench/decode: a smoke test of the benchmark on the tiny preset (not a timed test), the docs
section update and the optional onnxruntime-genai columns."""
from __future__ import annotations

import json
import sys

import pytest

from tools.bench import decode as bench
from tools.bench.docs import replace_section
from tools.bench.decode import SECTION, Workload


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def report(workdir):
    work = Workload(preset="tiny", batch_sizes=(1, 2), prompt_len=8, new_tokens=4, runs=1, threads=1, settle_s=0)
    variants = [("engine fp32", []), ("engine int4", ["quantization.mode=int4_rtn", "quantization.exclude=[]"])]
    return bench.run_benchmark(work, workdir, variants, ort_genai=(), command="pytest", log=lambda _: None)


def test_smoke_positive_decode_rates(report):
    by_key = {(r["backend"], r["batch_size"]): r for r in report["results"]}
    assert set(by_key) == {(b, n) for b in ("engine fp32", "engine int4", "transformers") for n in (1, 2)}
    for row in by_key.values():
        assert len(row["runs"]) == 1
        assert row["decode_tok_s"]["median"] > 0
        assert row["decode_tok_s"]["min"] <= row["decode_tok_s"]["median"] <= row["decode_tok_s"]["max"]
        assert row["ttft_s_median"] > 0
    measured = {(t["numerator"], t["denominator"], t["batch_size"]) for t in report["ratios"]}
    assert measured == {("engine fp32", "transformers", 1), ("engine fp32", "transformers", 2),
                        ("engine int4", "engine fp32", 1)}  # targets whose backends ran, at their batch sizes
    assert all(t["ratio"] > 0 and t["met"] == (t["ratio"] >= t["want"]) for t in report["ratios"])


def test_builds_measured_in_their_own_process(report):
    builds = report["builds"]
    assert set(builds) == {"engine fp32", "engine int4"}
    for b in builds.values():
        assert b["seconds"] > 0 and b["engine_mb"] > 0
        assert b["peak_rss_mb"] >= b["start_rss_mb"] > 0
    assert builds["engine int4"]["engine_mb"] < builds["engine fp32"]["engine_mb"]


def test_raw_json_written(report, workdir):
    saved = json.loads((workdir / "decode-tiny.json").read_text())
    assert saved["results"] == report["results"] and saved["workload"]["new_tokens"] == 4


def test_docs_section_replaced_and_others_kept(report, tmp_path):
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text(f"# Benchmarks\n\nintro\n\n{SECTION}\n\nold numbers\n\n```\n## not a heading\n```\n\n"
                    f"## Other section\n\nkeep me\n")
    section = bench.markdown_section(report)
    replace_section(docs, section)
    replace_section(docs, section)  # idempotent
    text = docs.read_text()
    assert text.count(SECTION) == 1 and "old numbers" not in text and "## not a heading" not in text
    assert text.startswith("# Benchmarks\n\nintro\n") and text.endswith("## Other section\n\nkeep me\n")
    assert "| engine fp32 / transformers | 1 |" in text and "| engine int4 |" in text and "pytest" in text


def test_missing_ort_genai_is_a_note_not_a_failure(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import raises ImportError
    path, stats, note = bench.build_ort_genai(tmp_path, tmp_path, threads=1, precision="int4", log=lambda _: None)
    assert path is None and stats is None and "not installed" in note
