"""engine-serve finds a busy port before it loads any engine (#23): one line naming host:port, exit 1, fast."""
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
