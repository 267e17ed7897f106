"""How engine-serve meets the network: uvicorn's settings (connection cap, keep-alive, bounded graceful
shutdown), a header read timeout uvicorn lacks, the Host allow-list that keeps web pages from driving a
local server (DNS rebinding), and RunningServer, the app on a thread of its own (tests, tools).

A connection that has not sent a request's headers within `header_timeout` of opening (or of its last
response) is closed; a request's body has `body_timeout` to arrive (server.py answers 408). Beyond
`max_connections` open connections or requests, new requests get a 503. On SIGTERM the server stops
accepting and lets requests finish for `shutdown_timeout`; shortly before it ends, what is still generating
or queued is cancelled and answered (a 503, or a final error event on a stream), then what is left (a client
that stopped reading a stream) is cut and the process exits."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass, fields

from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.config import option_field

log = logging.getLogger("engine-serve")

# Idle keep-alive connections are closed after this long: longer than clients keep them (httpx, and so the
# openai client: 5 s), or a client can reuse a connection the server is closing and get a ReadError.
KEEP_ALIVE_S = 30
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Transport:
    """Connection-level bounds; engine-serve's flags derive from these fields (runtime.cli.option_spec)."""

    header_timeout: float = option_field(10.0, "Seconds a connection has to send a request's headers before it is closed.")
    body_timeout: float = option_field(30.0, "Seconds a request has to send its body (408 after).")
    max_connections: int = option_field(256, "Open connections or requests before new requests get 503.", minimum=1)
    shutdown_timeout: float = option_field(10.0, "Seconds requests get to finish on SIGTERM before they are cancelled.")

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be > 0, got {getattr(self, f.name)}")


def default_hosts(host: str, extra: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The Host header names accepted: bound to a loopback address, only loopback names (plus `extra`);
    bound elsewhere, any name unless `extra` lists them (None: no check)."""
    if host in LOOPBACK:
        return LOOPBACK + tuple(extra)
    return tuple(extra) or None


def _host_name(header: str) -> str:
    """'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostGuard:
    """ASGI middleware: a request whose Host header names no allowed host is a 400 before the app runs."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app, self.allowed = app, {h.lower() for h in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if _host_name(host).lower() not in self.allowed:
                log.warning("refused a request for Host %.60r (allowed: %s)", host, ", ".join(sorted(self.allowed)))
                body = (b'{"error":{"message":"this Host is not served here (see engine-serve --allowed-host)",'
                        b'"type":"invalid_request_error","param":null,"code":"invalid_host"}}')
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol that closes a connection whose request headers are late."""

    class HeaderTimeout(H11Protocol):
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and (self._timer is None or self._armed_for is not self.cycle):
                self._arm()  # the next request on a kept-alive connection has begun: its headers are timed
            super().data_received(data)

        def _arm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._armed_for = self.cycle  # the request before the one being waited for (None: the first)
            self._timer = self.loop.call_later(header_timeout, self._late)

        def _late(self) -> None:
            self._timer = None
            if self.cycle is self._armed_for and not self.transport.is_closing():  # no new request since
                log.warning("closed a connection from %s: no request headers within %g s",
                            (self.client or ("?",))[0], header_timeout)
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeout


def config(app, transport: Transport, **options):
    """uvicorn.Config for `app` with the bounds of `transport` (`options`: host, port, ...)."""
    import uvicorn

    return uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=KEEP_ALIVE_S,
                          http=protocol(transport.header_timeout), limit_concurrency=transport.max_connections,
                          timeout_graceful_shutdown=transport.shutdown_timeout, **options)


def _uvicorn_server(app, transport: Transport, **options):
    """uvicorn.Server for `app`; when `app.state.stop_generation` exists it is called shortly before the
    shutdown grace period ends (create_app's: every open request is answered 503, every open stream gets a
    final error event), so what is cut is told so before uvicorn cancels what is left."""
    import uvicorn

    stop = getattr(getattr(app, "state", None), "stop_generation", None)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            grace = transport.shutdown_timeout
            timer = asyncio.get_running_loop().call_later(grace - min(1.0, grace / 4), stop) if stop else None
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    return Server(config(app, transport, **options))


def serve(app, transport: Transport, host: str, port: int) -> None:
    """Serve `app` on host:port until SIGTERM or Ctrl-C (then shut down within the transport's bounds)."""
    _uvicorn_server(app, transport, host=host, port=port).run()


class RunningServer:
    """A uvicorn server on a thread of its own: `url`, and `stop()` to shut it down."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, transport: Transport | None = None):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        self._server = _uvicorn_server(app, transport or Transport())
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="engine-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("engine-serve did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
