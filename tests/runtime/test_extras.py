"""Console scripts and their extras: a missing optional package is one line naming the extra to install, never a
traceback, and --help still says what the command does; with the extras installed every script answers -h and
--help with its full option list."""
from __future__ import annotations

import subprocess
import sys

import pytest

from runtime import extras


def _without(script: str, monkeypatch) -> tuple[str, str]:
    extra, modules, _ = extras.SCRIPTS[script]
    real = extras.importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name: None if name == modules[0] else real(name))
    return extra, modules[0]


@pytest.mark.parametrize("script", sorted(extras.SCRIPTS))
def test_a_missing_extra_is_one_line_naming_the_install(script, monkeypatch, capsys):
    extra, gone = _without(script, monkeypatch)
    monkeypatch.setattr(sys, "argv", [script, "--engine", "x"])
    with pytest.raises(SystemExit) as exit_:
        getattr(extras, script.replace("-", "_"))()
    out, err = capsys.readouterr()
    assert exit_.value.code == 1 and len(err.strip().splitlines()) == 1 and out == ""
    assert f'pip install -e ".[{extra}]"' in err and f"missing: {gone}" in err and "Traceback" not in err


@pytest.mark.parametrize("script", sorted(extras.SCRIPTS))
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_without_the_extra_says_what_the_command_does_and_how_to_install_it(script, flag, monkeypatch, capsys):
    extra, gone = _without(script, monkeypatch)
    monkeypatch.setattr(sys, "argv", [script, flag])
    with pytest.raises(SystemExit) as exit_:
        getattr(extras, script.replace("-", "_"))()
    out, err = capsys.readouterr()
    assert exit_.value.code == 0 and out.startswith(f"Usage: {script}") and "Traceback" not in err
    assert f'pip install -e ".[{extra}]"' in out and f"missing: {gone}" in err
    assert len(out.splitlines()) > 4  # the module's docstring: what the command does


def test_onnxruntime_missing_mentions_the_gpu_extra_without_a_clash(monkeypatch):
    real = extras.importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name: None if name == "onnxruntime" else real(name))
    message = extras.missing_extra_message("engine-run")
    assert '".[cpu]"' in message and '".[gpu]"' in message and "must not both be installed" in message


@pytest.mark.parametrize("script", sorted(extras.SCRIPTS))
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_every_script_answers_help(script, flag):
    code = f"import sys; sys.argv = [{script!r}, {flag!r}]; from runtime import extras; extras.{script.replace('-', '_')}()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage:") and "Traceback" not in done.stderr
