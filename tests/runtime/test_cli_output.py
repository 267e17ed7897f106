"""What goes where on engine-run and engine-build (#23, #38): stdout carries only the generated text (engine-run)
and nothing from engine-build; the prompt echo, the build's log and its result line go to stderr, so
`engine-build ... && engine-run ... > out.txt` keeps exactly the completion and the terminal still shows it all."""
from __future__ import annotations

import io
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


def test_the_stats_line_starts_a_line_of_its_own(trained_engine):
    """`engine-run ... --stats > out.txt`: the prompt echo's line on stderr is ended before the stats line; with
    stdout and stderr on one terminal or file the completion's newline already ended it (no blank line)."""
    args = [sys.executable, "-m", "runtime.cli", "--engine", str(trained_engine), "--prompt", PROMPT,
            "--max-new-tokens", "4", "--temperature", "0", "--stats"]
    apart = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert apart.returncode == 0 and apart.stderr.startswith(PROMPT + "\nprompt "), apart.stderr
    together = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    completion, stats = apart.stdout, apart.stderr.split("\n", 1)[1].split(", time to first token")[0]
    assert together.returncode == 0 and together.stdout.startswith(PROMPT + completion + stats), together.stdout


def test_engine_build_logs_and_its_result_go_to_stderr_leaving_stdout_empty(tiny_checkpoint, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny_checkpoint), "limits": {"max_seq_len": 64}}))
    out = tmp_path / "engine"
    done = _run("builder.cli", "--recipe", str(recipe), "--out", str(out), "--verify")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "verify: ok" in done.stderr and "built in" in done.stderr
    assert done.stderr.endswith(f"engine written to {out}\n")


class _Stdin:
    def __init__(self, data: bytes, tty: bool):
        self.buffer, self._tty = io.BytesIO(data), tty

    def isatty(self) -> bool:
        return self._tty


def test_engine_run_without_prompt_says_on_a_terminal_that_it_reads_stdin(monkeypatch, capsys):
    from runtime import cli

    monkeypatch.setattr(sys, "stdin", _Stdin(b"def f(", tty=True))
    assert cli._read_stdin() == "def f("
    out, err = capsys.readouterr()
    assert out == "" and "reading the prompt from stdin" in err and "Ctrl-D" in err and "--prompt" in err
    monkeypatch.setattr(sys, "stdin", _Stdin(b"def f(", tty=False))  # a pipe: no hint, stderr stays clean
    assert cli._read_stdin() == "def f(" and capsys.readouterr().err == ""
