"""Console scripts and their extras: a missing optional package is one line naming the extra to install (for --help
too), never a traceback; with the extras installed every script answers -h and --help."""
from __future__ import annotations

import subprocess
import sys

import pytest

from runtime import extras


@pytest.mark.parametrize("script", sorted(extras.SCRIPTS))
def test_a_missing_extra_is_one_line_naming_the_install(script, monkeypatch, capsys):
    extra, modules, _ = extras.SCRIPTS[script]
    gone = modules[0]
    real = extras.importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name: None if name == gone else real(name))
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_:
        getattr(extras, script.replace("-", "_"))()
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and len(err.strip().splitlines()) == 1
    assert f'pip install -e ".[{extra}]"' in err and f"missing: {gone}" in err and "Traceback" not in err


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
