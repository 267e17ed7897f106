"""engine-serve's access log: one line per request with its method, path, status, generated tokens and latency,
written when the response's last byte is sent (a stream's too), at INFO on the engine-serve logger."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("engine-serve")


class AccessLog:
    """Pure ASGI middleware: a handler that knows how many tokens it generated puts them in `request.state.tokens`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, state = time.perf_counter(), [0], scope.setdefault("state", {})

        async def logged(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                line(scope, status[0], state.get("tokens"), time.perf_counter() - start)

        await self.app(scope, receive, logged)


def line(scope, status: int, tokens: int | None, seconds: float) -> None:
    client = (scope.get("client") or ("-",))[0]
    log.info('%s "%s %s" %d tokens=%s %.3fs', client, scope["method"], scope["path"][:80], status,
             "-" if tokens is None else tokens, seconds)
