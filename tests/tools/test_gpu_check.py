"""tools.bench.gpu_check on CPU (--device cpu --tiny): steps write their JSON as soon as they finish, a later
call resumes (done steps are not run again) and prints the table from whatever exists, a step whose tests
were all skipped is SKIPPED, a step past its time limit is TIMEOUT ("not measured" for the compiled peer),
and the transformers parity helper agrees with our float32 engine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tools.bench.gpu_check import STEPS, main
from tools.bench.parity import Reference, tokens_agree, trusted_length


def invoke(out, *args):
    result = CliRunner().invoke(main, ["--out", str(out), "--device", "cpu", "--tiny", "--repeats", "1", *args])
    assert result.exit_code == 0, result.output
    return result.output


def status(out, step):
    return json.loads((out / f"{step}.json").read_text())["status"]


def test_steps_write_results_and_resume(tmp_path):
    output = invoke(tmp_path, "--step", "build", "--step", "decode-fp")
    assert status(tmp_path, "build") == status(tmp_path, "decode-fp") == "measured"
    assert "ours float32 batch 8 tok/s" in output and "tests-small" in output and "not run" in output
    assert not (tmp_path / "correctness.json").exists()
    first = (tmp_path / "decode-fp.json").read_text()
    output = invoke(tmp_path, "--step", "all", "--budget-s", "100")  # only steps whose limit fits: none here
    assert "stopping before tests-small" in output and (tmp_path / "decode-fp.json").read_text() == first
    output = invoke(tmp_path, "--step", "correctness", "--step", "bandwidth", "--step", "decode-fp", "--step",
                    "step-overlap")
    assert status(tmp_path, "correctness") == "passed" and "of roofline" not in first
    assert status(tmp_path, "step-overlap") == "measured" and "overlap on" in output and "overlap ahead" in output  # same tokens every way
    assert (tmp_path / "decode-fp.json").read_text() == first  # done: not run again without --redo
    assert "identical" in output and "copy bandwidth GB/s" in output


def test_all_skipped_tests_are_skipped_not_passed(tmp_path):
    output = invoke(tmp_path, "--step", "tests-small")  # no CUDA here: every test_gpu.py test skips
    assert status(tmp_path, "tests-small") == "SKIPPED" and "SKIPPED" in output


def test_a_step_past_its_limit_is_not_measured(tmp_path):
    invoke(tmp_path, "--step", "hf-compile", "--limit-s", "1")
    assert status(tmp_path, "hf-compile") == "not measured"
    invoke(tmp_path, "--step", "build", "--limit-s", "1")
    assert status(tmp_path, "build") == "TIMEOUT"
    assert all(limit < 570 for limit, _ in STEPS.values())  # each step fits a 10-minute call with room


def test_settings_of_one_folder_cannot_change(tmp_path):
    invoke(tmp_path, "--table")
    result = CliRunner().invoke(main, ["--out", str(tmp_path), "--device", "cpu", "--repeats", "1", "--table"])
    assert result.exit_code != 0 and "give the same" in result.output


def test_trusted_length_stops_at_the_first_close_call():
    reference = Reference(tokens=[5, 6, 7, 8], gaps=[0.5, 0.3, 0.01, 0.4], first_logits=None)
    assert trusted_length(reference, 0.05) == 2 and trusted_length(reference, 0.001) == 4
    assert tokens_agree([5, 6, 9, 9], reference, 0.05) and not tokens_agree([5, 9, 7, 8], reference, 0.05)


@pytest.mark.parametrize("suite, code, expected", [
    ('tests="3" skipped="3" failures="0" errors="0"', 0, "SKIPPED"),
    ('tests="3" skipped="1" failures="0" errors="0"', 0, "passed"),
    ('tests="3" skipped="0" failures="1" errors="0"', 1, "FAILED"),
    ('tests="0" skipped="0" failures="0" errors="1"', 2, "FAILED"),  # a collection error
    (None, 4, "FAILED"),  # pytest died before writing its report
])
def test_test_steps_read_pytest_report(tmp_path, monkeypatch, suite, code, expected):
    import tools.bench.gpu_check as gpu_check

    def fake_pytest(command):
        if suite is not None:
            report = Path(command[-1].split("=", 1)[1])
            report.write_text(f'<testsuites><testsuite name="pytest" {suite}></testsuite></testsuites>')
        return code

    monkeypatch.setattr(gpu_check.subprocess, "call", fake_pytest)
    ctx, result = gpu_check.Context(tmp_path, "cpu", True, 1), gpu_check.Result("tests-small", "measured")
    gpu_check.run_tests(ctx, result, "small")
    assert result.status == expected
