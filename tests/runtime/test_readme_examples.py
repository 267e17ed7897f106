"""The README's Python API example runs as written on an engine with tiny_cpu.yaml's position limit (512)."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_api_example() -> str:
    text = README.read_text()
    section = text[text.index("### Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_python_api_example_runs(tiny_engine, capsys):
    code = _python_api_example().replace('"engines/tiny-llama"', repr(str(tiny_engine)))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    namespace["llm"].close()
    printed = capsys.readouterr().out
    assert printed.count(" length ") + printed.count(" stop ") >= 2  # two completions with their finish reasons
    assert "<|" in namespace["prompt"]  # the chat template was applied
