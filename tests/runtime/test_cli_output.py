"""What goes where on engine-run and engine-build (#23): stdout carries only the generated text (engine-run) or
the result line (engine-build); the prompt echo and the build's log go to stderr, so `> out.txt` keeps exactly
the completion and the terminal still shows the whole text."""
from __future__ import annotations

import subprocess
import sys

import yaml

from runtime.engine import LLM
from runtime.request.params import SamplingParams

PROMPT = "def read_config(path):"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300)


def test_engine_run_stdout_is_the_completion_and_the_prompt_echo_is_on_stderr(trained_engine):
    with LLM(str(trained_engine), max_batch_size=1) as llm:
        expected = llm.generate([PROMPT], SamplingParams(max_new_tokens=16, temperature=0))[0].text
    for stream in ([], ["--stream"]):
        done = _run("runtime.cli", "--engine", str(trained_engine), "--prompt", PROMPT, "--max-new-tokens", "16",
                    "--temperature", "0", *stream)
        assert done.returncode == 0, done.stderr
        assert done.stdout == expected + "\n"
        assert done.stderr == PROMPT
    quiet = _run("runtime.cli", "--engine", str(trained_engine), "--prompt", PROMPT, "--max-new-tokens", "4",
                 "--temperature", "0", "--no-echo")
    assert quiet.returncode == 0 and quiet.stderr == ""
    chat = _run("runtime.cli", "--engine", str(trained_engine), "--prompt", "add two numbers", "--chat",
                "--max-new-tokens", "4", "--temperature", "0")
    assert chat.returncode == 0 and chat.stderr == ""  # a reply does not continue the message: no echo


def test_engine_build_logs_on_stderr_and_prints_only_the_result_on_stdout(tiny_checkpoint, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny_checkpoint), "limits": {"max_seq_len": 64}}))
    out = tmp_path / "engine"
    done = _run("builder.cli", "--recipe", str(recipe), "--out", str(out), "--verify")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"engine written to {out}\n"
    assert "verify: ok" in done.stderr and "built in" in done.stderr
