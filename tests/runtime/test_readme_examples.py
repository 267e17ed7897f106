"""Every Python block of the README runs as written on the engine it names (engines/trained, built here from the
committed checkpoint), and the README's engine-run commands run; a block that stops working fails here."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_its_python_examples():
    assert len(PYTHON_BLOCKS) >= 3  # Python API, executor, asyncio
    assert all('"engines/trained"' in block for block in PYTHON_BLOCKS)


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)), ids=lambda i: PYTHON_BLOCKS[i].splitlines()[-2][:40])
def test_python_block_runs(index, trained_engine, capsys):
    code = PYTHON_BLOCKS[index].replace('"engines/trained"', repr(str(trained_engine)))
    namespace: dict = {"__name__": "readme"}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    printed = capsys.readouterr().out
    assert printed.strip(), "the example printed nothing"
    if "llm.generate([" in code:  # the Python API block: two completions with finish reasons, a chat prompt
        assert printed.count(" length ") + printed.count(" stop ") >= 2
        assert namespace["prompt"].startswith("# add two numbers\n")


def _engine_run_lines() -> list[str]:
    """engine-run command lines of the README's bash blocks, optional [..] parts dropped (they show choices)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("engine-run ") and "engines/trained" in line:
                lines.append(re.sub(r"\s\[[^\]]*\]", "", line.split("  #")[0]).strip())
    return lines


def test_engine_run_commands_run(trained_engine):
    lines = _engine_run_lines()
    assert any("--chat" in line for line in lines) and len(lines) >= 2
    for line in lines:
        argv = [a.replace("engines/trained", str(trained_engine)) for a in shlex.split(line)[1:]]
        done = subprocess.run([sys.executable, "-m", "runtime.cli", *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip(), (line, done.stderr)
