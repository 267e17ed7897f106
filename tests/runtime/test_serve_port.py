"""engine-serve at start: a busy port is found before any engine loads (#23: one line naming host:port, exit 1,
fast); an engine or option it cannot serve is one line in its flags; limits and executor options reach the engines."""
from __future__ import annotations

import socket
import subprocess
import sys
import time


def test_a_busy_port_is_refused_before_the_engines_load(trained_engine):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "runtime.serve.app", "--engine", str(trained_engine), "--port",
                               str(port)], capture_output=True, text=True, timeout=60)
        elapsed = time.perf_counter() - start
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "engine-serve: " not in done.stderr  # the serving line comes after loading: nothing was loaded
    assert elapsed < 30


def _serve_error(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.serve.app", "--port", "0", *args], capture_output=True,
                          text=True, timeout=60)


def test_an_engine_it_cannot_load_is_one_line_in_flags_not_a_traceback(trained_engine, tmp_path):
    """A missing engine directory, an impossible limit or an option the device cannot run: exit 2 with one line
    that names the problem in engine-serve's flags (the runtime's errors name Python arguments)."""
    cases = [(["--engine", str(tmp_path / "nope")], "no such directory"),
             (["--engine", str(trained_engine), "--max-seq-len", "999999"], "--max-seq-len 999999 is outside 2..1024"),
             (["--engine", str(trained_engine), "--lookahead", "4"], "pass --overlap, or --lookahead 1"),
             (["--engine", str(trained_engine), "--device", "cuda"], "a float32 engine cannot run on cuda")]
    for args, expected in cases:
        done = _serve_error(*args)
        assert done.returncode == 2 and done.stderr.startswith("engine-serve: error: "), done.stderr
        assert expected in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_limits_and_the_executor_options_reach_the_engines(trained_engine, monkeypatch):
    """--max-batch-size / --max-seq-len are upper bounds chosen at load, as for engine-run and LLM; --overlap and
    --lookahead reach the executor."""
    from click.testing import CliRunner

    from runtime.serve import app

    served = {}

    def serve(application, *rest):  # instead of listening: what each engine was loaded with
        for name, engine in application.state.server.engines.items():
            llm = engine.llm
            served[name] = (llm.spec.slots, llm.spec.max_seq_len, llm.executor.lookahead, llm.executor._engine is not None)

    monkeypatch.setattr(app, "serve", serve)
    result = CliRunner().invoke(app.main, ["--engine", f"m={trained_engine}", "--port", "0", "--max-batch-size", "3",
                                           "--max-seq-len", "256", "--overlap", "--lookahead", "5"])
    assert result.exit_code == 0, result.output
    assert served == {"m": (3, 256, 5, True)}
