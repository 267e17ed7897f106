"""engine-bench: every workload runs end to end on the tiny engine with tiny sizes and writes a
complete result (a smoke test of structure, not of speed)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from builder.build import build_engine
from builder.recipe import load_recipe
from tools.engine_bench.config import LengthDist
from tools.bench.docs import replace_section
from tools.engine_bench import report
from tools.engine_bench.report import section_heading
from tools.engine_bench.cli import main

TINY = ["--batch", "1,3", "--input-len", "8", "--output-len", "4",
        "--num-requests", "5", "--rate", "50", "--input-len-dist", "uniform:4:16", "--output-len-dist", "uniform:2:6",
        "--concurrency", "1,2,4,8", "--requests-per-client", "1", "--min-sweep-requests", "3",
        "--prefix-len", "40", "--suffix-len-dist", "uniform:2:4", "--prefix-requests", "3", "--prefix-output-len", "2",
        "--spec-requests", "2", "--spec-prompt-len", "64", "--spec-output-len", "12", "--spec-concurrency", "1,2,8",
        "--kv-rows", "2", "--kv-clients", "4", "--kv-requests", "6", "--kv-prompt-len-dist", "uniform:4:40",
        "--kv-output-len-dist", "uniform:2:30", "--kv-prefix-len", "32", "--kv-prefix-clients", "3",
        "--kv-stagger-s", "0.01"]


@pytest.fixture(scope="module")
def self_draft(tiny_checkpoint, tmp_path_factory):
    """A self-draft: the tiny checkpoint quantized to int4."""
    recipe = load_recipe(base={"model": str(tiny_checkpoint)},
                         overrides=["limits.max_seq_len=96", "verify.enabled=off", "quantization.mode=int4_rtn",
                                    "quantization.group_size=32"])
    return build_engine(recipe, tmp_path_factory.mktemp("draft") / "int4", log=lambda _: None)


@pytest.fixture(scope="module")
def bench(tiny_engine, tiny_checkpoint, self_draft, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    docs = out / "BENCHMARKS.md"
    docs.write_text("# Benchmarks\n\n## Another helper's section\n\nkeep me\n")
    args = ["--engine", str(tiny_engine), "--checkpoint", str(tiny_checkpoint), "--workload", "all",
            "--draft", str(self_draft),
            "--out", str(out / "results"), "--write-docs", str(docs), *TINY]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out, json.loads((out / "results" / "results.json").read_text()), result.output


def summaries(doc):
    return [(w, p, m, s) for w, points in doc["results"].items() for p, modes in points.items()
            for m, s in modes.items()]


def test_every_workload_and_mode_reports(bench):
    _, doc, _ = bench
    assert set(doc["results"]) == {"fixed", "stream", "concurrency", "prefix", "speculative", "kv"}
    for batch in ("batch=1", "batch=3"):
        assert set(doc["results"]["fixed"][batch]) == {"in-flight", "static", "single-stream", "transformers"}
    assert set(doc["results"]["stream"]["rate=50/s"]) == {"in-flight", "static", "single-stream", "transformers"}
    sweep = doc["results"]["concurrency"]
    assert list(sweep) == ["C=1", "C=2", "C=4"]  # 8 clients exceed the tiny engine's 4 KV slots
    assert doc["skipped"] == ["concurrency 8 > 4 KV slots", "speculative C=8 > 4 KV slots"]
    assert {"single-stream", "static", "in-flight"} <= set(sweep["C=4"])
    assert set(doc["results"]["prefix"]["prefix=40"]) == {"reuse on", "reuse off"}


def test_speculation_against_none_on_the_same_prompts(bench):
    _, doc, _ = bench
    points = doc["results"]["speculative"]
    assert list(points) == ["copy C=1", "copy C=2", "code C=1", "code C=2"]
    for modes in points.values():
        assert list(modes) == ["no speculation", "ngram", "draft (self, int4_rtn)"]
        base = modes["no speculation"]
        assert base["drafted"] == 0 and base["acceptance_rate"] is None
        for mode in ("ngram", "draft (self, int4_rtn)"):
            s = modes[mode]
            assert s["output_tokens"] == base["output_tokens"] == 2 * 12
            assert s["outputs_digest"] == base["outputs_digest"]  # greedy: speculation changes no token
            assert s["decode_tok_s"] > 0
        assert modes["draft (self, int4_rtn)"]["drafted"] > 0
    copy = points["copy C=1"]["ngram"]
    assert copy["drafted"] > 0 and 0 <= copy["acceptance_rate"] <= 1
    names = [t["target"] for t in doc["targets"]]
    assert "copy C=1: ngram decode speedup" in names and "code C=1: draft (self, int4_rtn) decode speedup" in names


def test_summaries_have_throughput_and_percentiles(bench):
    _, doc, _ = bench
    for workload, point, mode, s in summaries(doc):
        assert s["throughput_tok_s"] > 0 and s["requests"] >= 1, (workload, point, mode)
        for metric in ("ttft_s", "tpot_s", "latency_s"):
            assert set(s[metric]) == {"p50", "p90", "p99"}
            assert s[metric]["p50"] is not None and s[metric]["p50"] >= 0
    flight = doc["results"]["concurrency"]["C=4"]["in-flight"]["breakdown"]
    assert flight["steps"] > 0 and flight["decode_s"] > 0 and flight["extend_tokens"] > 0


def test_full_load_throughput(bench):
    """Closed loop: throughput while every client had a request in flight. Static batches are full
    until the last one, so theirs is the whole run; open-loop streams have none."""
    _, doc, _ = bench
    sweep = doc["results"]["concurrency"]
    for point in ("C=1", "C=2", "C=4"):
        assert sweep[point]["in-flight"]["full_load_tok_s"] > 0
        assert sweep[point]["static"]["full_load_tok_s"] == sweep[point]["static"]["throughput_tok_s"]
    assert doc["results"]["stream"]["rate=50/s"]["in-flight"]["full_load_tok_s"] is None
    assert "(full load)" in doc["targets"][0]["target"]


def test_closed_loop_reports_the_first_client_out_once():
    from tools.engine_bench.drivers import _closed_loop

    class Done:
        def __init__(self, r):
            self.r = r

        def result(self):
            return self.r

    calls = []
    done = _closed_loop(Done, list(range(7)), 3, lambda: calls.append(len(calls)))
    assert sorted(done) == list(range(7)) and calls == [0]


def test_exact_token_counts(bench):
    _, doc, _ = bench
    fixed = doc["results"]["fixed"]["batch=3"]
    assert {s["output_tokens"] for s in fixed.values()} == {12}
    reuse = doc["results"]["prefix"]["prefix=40"]
    assert reuse["reuse on"]["reused_prompt_tokens"] >= 2 * 32  # every request after the first: 2 whole 16-token blocks
    assert reuse["reuse off"]["reused_prompt_tokens"] == 0


def test_kv_workload_serves_every_request_and_reports_kv_figures(bench):
    _, doc, output = bench
    kv = doc["results"]["kv"]
    mixed = kv["mixed C=4, budget 2 rows"]
    assert mixed["slots (rows = budget / max_seq_len)"]["requests"] == mixed["blocks"]["requests"] == 6
    overload = next(v for k, v in kv.items() if k.startswith("2x overload"))["blocks"]
    assert overload["breakdown"]["kv_blocks_total"] == 2 * 96 // 16  # every request completed (else the run fails)
    shared = kv["shared prefix 32"]
    assert shared["cache on"]["breakdown"]["prefix_cache_hit_tokens"] == 2 * 32  # the 2nd and 3rd request
    assert shared["cache off"]["breakdown"]["prefix_cache_hit_tokens"] == 0
    assert "| recomputed tokens |" in output


def test_outputs_written(bench):
    out, doc, output = bench
    results = out / "results"
    for name in ("results.json", "results.md", "throughput_vs_concurrency.png", "latency_percentiles.png"):
        assert (results / name).stat().st_size > 0
    assert [t["target"].split(":")[0] for t in doc["targets"]][:3] == ["C=4 mixed lengths"] * 3
    assert all(isinstance(t["passed"], bool) for t in doc["targets"]) and len(doc["targets"]) == 6
    assert doc["complete"] and len(doc["load_average_end"]) == 3
    assert "PASS" in output or "FAIL" in output or "n/a for this engine" in output
    assert "FAIL" not in output  # the tiny engine is not the model the targets are for (issue 13)
    docs = (out / "BENCHMARKS.md").read_text()
    heading = section_heading(doc["engine"]["dir"], ("fixed", "stream", "concurrency", "prefix", "speculative", "kv"))
    assert heading == "## engine-bench: fixed, stream, concurrency, prefix, speculative, kv on `tiny`"
    assert "keep me" in docs and docs.count(heading) == 1 and "engine-bench --engine" in docs


def test_replace_section_keeps_other_sections(tmp_path):
    SECTION = "## engine-bench: fixed on `x`"
    path = tmp_path / "B.md"
    path.write_text(f"# B\n\n{SECTION}\n\nold\n\n## Other\n\nkeep\n")
    replace_section(path, f"{SECTION}\n\nnew\n")
    text = path.read_text()
    assert "new" in text and "old" not in text and text.index(SECTION) < text.index("## Other") and "keep" in text


@pytest.mark.parametrize("text, expected", [("uniform:32:512", LengthDist("uniform", 32, 512)),
                                            ("128", LengthDist("fixed", 128, 128)),
                                            ("fixed:7", LengthDist("fixed", 7, 7))])
def test_length_distributions(text, expected):
    assert LengthDist.parse(text) == expected
    assert LengthDist.parse(str(expected)) == expected


def test_workload_too_long_is_refused(tiny_engine, tmp_path):
    result = CliRunner().invoke(main, ["--engine", str(tiny_engine), "--workload", "fixed", "--batch", "1",
                                       "--input-len", "90", "--output-len", "20", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "max_seq_len 96" in result.output


def test_flags_render_as_flags_in_the_command_line(tmp_path):
    from tools.engine_bench.config import BenchConfig

    cfg = BenchConfig(engine=tmp_path, process_thread_pool=True, max_running=12)
    assert cfg.command_line().endswith("--max-running 12 --process-thread-pool")
    assert "--process-thread-pool" not in BenchConfig(engine=tmp_path).command_line()


def test_a_failed_applicable_target_exits_non_zero_and_every_table_prints(bench, capsys):
    """engine-bench's summary: an applicable target that fails makes the run fail (exit status 1), and a
    speculative-only run prints its own table instead of an empty one."""
    from tools.engine_bench.cli import print_summary

    _, doc, _ = bench
    assert print_summary(doc)  # the tiny engine: every target is n/a, nothing failed
    failing = dict(doc, engine=dict(doc["engine"], parameters=200_000_000),
                   targets=[dict(t, passed=False) for t in doc["targets"] if "decode speedup" not in t["target"]])
    assert failing["targets"] and not print_summary(failing)
    capsys.readouterr()
    assert print_summary(dict(doc, results={"speculative": doc["results"]["speculative"]}, targets=[]))
    printed = capsys.readouterr().out
    assert "| workload | point | mode |" not in printed
    assert report.speculative_markdown({"speculative": doc["results"]["speculative"]}).splitlines()[0] in printed
