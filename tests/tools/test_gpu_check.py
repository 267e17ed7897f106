"""tools.gpu.check rehearsed on CPU, so nothing in it is first run on a lent GPU: `--quick --device cpu` runs the
whole plan (small shapes) in one call and every step reaches its verdict; a deadline of a few seconds stops the
run cleanly with partial results and exit 0 (a step past its own cap is killed and the next one still runs in
a fresh process); what comes back is three files; the dry run plans calls that fit what one call carries."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from tools.bench.parity import Reference, hf_references, logits_close, tokens_agree, trusted_length
from tools.gpu import check
from tools.gpu.check import CORRECTNESS, FINAL, PLANS, STEPS, Step, main
from tools.gpu.setup import CALL_MIB, TREE_MIB, part_sizes, plan, tree_bytes
from tools.gpu.steps import SAME_TRUSTED, agreement


def run(out, work, *args):
    result = CliRunner().invoke(main, ["--quick", "--device", "cpu", "--out", str(out), "--work", str(work), *args])
    assert result.exit_code == 0, result.output
    return result.output, json.loads((out / "check.json").read_text())["steps"]


def test_the_quick_plan_runs_end_to_end_on_cpu(tmp_path):
    output, steps = run(tmp_path / "out", tmp_path / "work")
    assert list(steps) == list(STEPS) and all(s["status"] in FINAL for s in steps.values())
    failed = {name: s["rows"] for name, s in steps.items()
              if s["status"] not in ("passed", "measured", "SKIPPED") and name in PLANS["default"]}
    assert not failed
    assert all(steps[name]["status"] == "not run" for name in STEPS if name not in PLANS["default"])
    assert all(steps[name]["status"] == "passed" for name in CORRECTNESS if name in PLANS["default"] and name != "paged")
    assert steps["paged"]["status"] == steps["paged-capacity"]["status"] == "SKIPPED"  # no CPU kernel
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"check.json", "check.log", "table.txt"}  # <= 8 come back
    table = (tmp_path / "out" / "table.txt").read_text()
    assert all(name in table and name in output for name in PLANS["default"])
    assert "in-flight batch of 6 vs each alone" in table and "fp batch 8 tok/s" in table and "of the roofline" in table
    assert "== tp2: passed" in (tmp_path / "out" / "check.log").read_text()
    assert "pp2, 2 micro-batches (stages on one device) vs pp1" in table and steps["pp-cuda"]["status"] == "passed"


def test_the_headline_plan_runs_end_to_end_on_cpu(tmp_path):
    """Issue 46's visit rehearsed: the 7B recipe as written (on a small Llama, float32 on CPU) and its three twins
    built at once, tp2 against tp1, the float engine against transformers, decode with each weight-kernel choice,
    engine-serve under streaming clients; the kernel probe's layers against their float reference; SmolLM2 from its
    GGUF against transformers from the same file (float activations on CPU, as on CUDA)."""
    output, steps = run(tmp_path / "out", tmp_path / "work", "--plan", "headline")
    ran = {name: s for name, s in steps.items() if name in PLANS["headline"]}
    assert list(ran) == list(PLANS["headline"]) and not [n for n, s in ran.items() if s["status"] not in ("passed", "measured")]
    assert ran["headline-tp"]["status"] == ran["headline-parity"]["status"] == "passed"
    rows = {what: figure for s in ran.values() for what, figure, _ in s["rows"]}
    assert rows["int8 tp2 (one GPU, gloo) vs tp1, 8 prompts"] == "identical"
    assert {"int8-tp1 fpa_intb batch 32 tok/s", "int4-tp1 ort batch 1 tok/s", "int4 b128 fpa_intb M8 us/layer"} <= set(rows)
    assert rows["4 streaming clients: failed requests"] == "0"
    assert all(rows[f"build {name} s"] for name in ("int8-tp2", "int8-tp1", "fp16-tp1", "int4-tp1"))
    assert ran["smollm2-cuda"]["status"] == "passed"  # the real GGUF on the device against transformers from it
    assert rows["smollm2 float32: greedy vs transformers"] == "same" and "smollm2 batch 8 tok/s" in rows


def test_a_short_deadline_stops_cleanly_with_partial_results(tmp_path, monkeypatch):
    """Deadline 8 s, trained-build capped at 1 s: that step is killed (TIMEOUT), the next starts in a fresh process
    and fails with its reason (no engine), the run stops at the deadline and exits 0 with the table."""
    monkeypatch.setitem(STEPS, "trained-build", Step(1, 1, check.trained_build))
    start = time.monotonic()
    output, steps = run(tmp_path / "out", tmp_path / "work", "--deadline-s", "8")
    assert time.monotonic() - start < 30
    assert steps["provider"]["status"] == "passed"
    assert steps["trained-build"]["status"] == "TIMEOUT" and "past its 1 s cap" in str(steps["trained-build"]["rows"])
    assert steps["trained-greedy"]["status"] in ("FAILED", "TIMEOUT")
    assert list(steps) == list(STEPS) and all(s["status"] in FINAL for s in steps.values())
    assert steps["peers"]["status"] == "not run" and "not run" in output and "peers" in output


def test_a_step_whose_process_dies_is_failed_and_the_next_runs_in_a_fresh_one(tmp_path, monkeypatch):
    """The worker is replaced by a script: the first process marks its first step running and dies (exit 3), the
    second marks its first step passed."""
    real, spawned = subprocess.Popen, []

    def fake_worker(command, **kwargs):
        names = command[command.index("--worker") + 1].split(",")
        spawned.append(names)
        script = (f"import json, sys, time; p = {str(tmp_path / 'out' / 'check.json')!r}; d = json.load(open(p)); "
                  f"d['steps'][{names[0]!r}] = dict(status={'running' if len(spawned) == 1 else 'passed'!r}, rows=[], "
                  f"values={{}}, seconds=0.0, started=time.time()); json.dump(d, open(p, 'w')); "
                  f"sys.exit({3 if len(spawned) == 1 else 0})")
        return real([sys.executable, "-c", script], **kwargs)

    monkeypatch.setattr(check.subprocess, "Popen", fake_worker)
    _, steps = run(tmp_path / "out", tmp_path / "work", "--step", "trained-greedy", "--step", "ahead")
    assert spawned == [["trained-greedy", "ahead"], ["ahead"]]
    assert steps["trained-greedy"]["status"] == "FAILED" and "exit code 3" in str(steps["trained-greedy"]["rows"])
    assert steps["ahead"]["status"] == "passed" and steps["provider"]["note"] == "not asked"


def test_the_dry_run_plans_calls_that_fit(tmp_path):
    """Every call carries the working tree and one part, under a call's 64 MiB; the tree stays under its bound;
    COMMANDS.txt holds one command per call, the last one installs and runs the check."""
    assert tree_bytes() <= TREE_MIB << 20
    text = plan(tmp_path / ".gpu", 420, {name: s.estimate_s for name, s in STEPS.items()})
    lines = (tmp_path / ".gpu" / "COMMANDS.txt").read_text().splitlines()
    calls = [line for line in lines if line.startswith("  ")]
    assert len(calls) == len(part_sizes(tmp_path / ".gpu")) + 1 and "OVER" not in text
    assert "tools.gpu.check --quick --out $OUT" in calls[-2] and "sha256sum -c" in calls[-2]
    assert all(len(c) < 2000 for c in calls) and "time budget" in text and "of 900" in text
    assert all(tree_bytes() + size <= CALL_MIB << 20 for size in part_sizes(tmp_path / ".gpu"))
    assert sum(STEPS[n].estimate_s for n in PLANS["default"]) <= check.DEADLINE_S  # the whole plan is meant to fit


def test_the_dry_run_command_prints_the_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "ROOT", tmp_path)
    result = CliRunner().invoke(main, ["--dry-run"])
    assert result.exit_code == 0, result.output
    assert "call 1 of" in result.output and (tmp_path / ".gpu" / "COMMANDS.txt").exists()


@pytest.mark.parametrize("args", [[], ["--device", "cpu"]])
def test_without_out_the_check_says_what_is_missing(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "give --out" in result.output


def test_trusted_length_stops_at_the_first_close_call():
    reference = Reference(tokens=[5, 6, 7, 8], gaps=[0.5, 0.3, 0.01, 0.4], first_logits=None)
    assert trusted_length(reference, 0.05) == 2 and trusted_length(reference, 0.001) == 4
    assert tokens_agree([5, 6, 9, 9], reference, 0.05) and not tokens_agree([5, 9, 7, 8], reference, 0.05)


def test_half_precision_noise_widens_the_trusted_bounds():
    """A step whose gap is under twice transformers' own half-precision error there is not trusted, and the first
    logits may be that far from the float32 truth (the 1B-shape checkpoint: float16 alone is 0.4 off)."""
    reference = Reference(tokens=[5, 6, 7], gaps=[0.5, 0.3, 0.4], first_logits=np.zeros(4, np.float32),
                          noise=[0.2, 0.1, 0.25])
    assert trusted_length(reference, 0.05) == 2  # 0.4 < 2 * 0.25
    assert logits_close(np.full(4, 0.39, np.float32), reference, "float16")[0]
    assert not logits_close(np.full(4, 0.41, np.float32), reference, "float16")[0]
    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 6]], cut=[2, 1]) == SAME_TRUSTED
    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 6]], cut=[3, 1]).startswith("DIFFER")


def test_half_references_are_the_float32_path_with_the_half_runs_error(tmp_path):
    """hf_references for float16 (rehearsed on CPU, tiny random model): the float32 greedy tokens, and per step
    how far transformers' float16 logits are from them; float32 references carry no noise."""
    from tools.checkpoints.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", initializer_range=0.1, seed=0)
    prompts = [[3, 9, 27, 81], [5, 7]]
    exact = hf_references(ckpt, prompts, 4, "cpu", "float32")
    half = hf_references(ckpt, prompts, 4, "cpu", "float16")
    assert [r.tokens for r in half] == [r.tokens for r in exact] and all(r.noise is None for r in exact)
    assert all(len(r.noise) == 4 and 0 < max(r.noise) < 0.1 for r in half)
