"""engine-run's errors name its flags, not the Python API's arguments (#23: one voice per surface)."""
from __future__ import annotations

import subprocess
import sys

from runtime.cli import cli_voice


def test_python_arguments_become_flags():
    message = cli_voice("prompt 0: 1 prompt tokens + max_new_tokens 5000 = 5001 exceeds max_seq_len 1024; use "
                        "max_new_tokens <= 1023 or load the engine with a larger max_seq_len")
    assert message.endswith("use --max-new-tokens <= 1023 or pass a larger --max-seq-len")
    assert cli_voice("limits.max_seq_len is 512") == "limits.max_seq_len is 512"  # a recipe key stays a recipe key
    assert cli_voice("speculation method 'draft' needs a draft engine") == "speculation method 'draft' needs a draft engine"


def test_engine_run_errors_speak_in_flags(trained_engine):
    for argv, said in ((["--max-new-tokens", "5000"], "use --max-new-tokens <= "),
                       (["--speculate", "draft"], "pass --draft DIR")):
        done = subprocess.run([sys.executable, "-m", "runtime.cli", "--engine", str(trained_engine), "--prompt", "x",
                               *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert "max_new_tokens" not in done.stderr and "draft=" not in done.stderr
