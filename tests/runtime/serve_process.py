"""engine-serve in a process of its own (tests that send it SIGTERM): the trained engine on 127.0.0.1, a 2 s
shutdown grace, started and waited for until /health answers."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
SERVE = """
import sys
from runtime.engine import LLM
from runtime.serve.app import Transport, create_app
from runtime.serve.transport import serve

llm = LLM(sys.argv[1], max_batch_size=int(sys.argv[3]) if len(sys.argv) > 3 else None)
if len(sys.argv) > 4:  # a decode step at least this many ms: requests that outlast the grace, however fast the box
    import time
    decode, delay = llm.runner.decode, float(sys.argv[4]) / 1000

    def slow_decode(*args, **kwargs):
        time.sleep(delay)
        return decode(*args, **kwargs)

    llm.runner.decode = slow_decode
transport = Transport(shutdown_timeout=2.0)
try:
    serve(create_app({"trained": llm}, transport=transport), transport, "127.0.0.1", int(sys.argv[2]))
finally:
    llm.close()
"""


def start(engine: Path, *args: str) -> tuple[subprocess.Popen, int]:
    """The server process (stderr piped, text) and its port, once /health answers; `args`: max_batch_size, and
    optionally a minimum decode step in ms."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(engine), str(port), *args], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc, port
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the server did not start") from None
            time.sleep(0.1)
