"""engine-run's --stop reads \\n, \\t and \\\\ as escapes: a shell passes "\\n" as a backslash and an n (#23)."""
from __future__ import annotations

import subprocess
import sys

from runtime.cli import _unescape


def test_escapes_become_the_characters_they_name():
    assert _unescape(None, None, ("\\n\\n", "a\\tb", "x\\\\n", "plain", "\n")) == ("\n\n", "a\tb", "x\\n", "plain", "\n")


def test_a_blank_line_stop_ends_generation_at_the_first_blank_line(trained_engine):
    argv = ["--engine", str(trained_engine), "--prompt", "def read_config(path):", "--max-new-tokens", "64"]
    free = subprocess.run([sys.executable, "-m", "runtime.cli", *argv], capture_output=True, text=True, timeout=120)
    stopped = subprocess.run([sys.executable, "-m", "runtime.cli", *argv, "--stop", "\\n\\n"], capture_output=True,
                             text=True, timeout=120)
    assert free.returncode == stopped.returncode == 0, stopped.stderr
    assert "\n\n" in free.stdout.rstrip("\n")  # without the stop string the text has a blank line
    assert stopped.stdout.rstrip("\n") == free.stdout[:free.stdout.index("\n\n")].rstrip("\n")
