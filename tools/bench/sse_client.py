"""A lean streaming HTTP/1.1 client for load tools: one keep-alive connection (h11 over asyncio streams)
that POSTs JSON and yields the server-sent events' data. The soak's clients run on the same cores as the
server they measure; through httpx (httpcore, anyio, line decoding) a client spent more CPU per token than
the server's event loop, so this one stays thin."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import h11


class StreamError(Exception):
    """The request failed: a status other than 200, a broken connection, or bad HTTP."""


class SSEConnection:
    """`async for data in connection.post(path, body)`: each event's `data:` payload (bytes)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._conn: h11.Connection | None = None

    async def post(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        try:
            async for data in self._exchange(path, body):
                yield data
        except (OSError, h11.ProtocolError, asyncio.IncompleteReadError) as err:
            self.close()  # the next request opens a new connection
            raise StreamError(f"{type(err).__name__}: {err}") from None
        except BaseException:
            self.close()  # left mid-response: the connection cannot be reused
            raise

    async def _exchange(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        if self._conn is None or self._conn.our_state is not h11.IDLE:
            await self._open()
        conn, pending = self._conn, b""
        headers = [("Host", f"{self.host}:{self.port}"), ("Content-Type", "application/json"),
                   ("Content-Length", str(len(body)))]
        self._writer.write(conn.send(h11.Request(method="POST", target=path, headers=headers)) +
                           conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self._reader.read(1 << 16))
            elif isinstance(event, h11.Response) and event.status_code != 200:
                raise StreamError(f"HTTP {event.status_code}")
            elif isinstance(event, h11.Data):
                *events, pending = (pending + event.data).split(b"\n\n")
                for e in events:
                    if e.startswith(b"data: "):
                        yield e[6:]
            elif isinstance(event, h11.EndOfMessage):
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()  # keep-alive
                else:
                    self.close()
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise StreamError("the server closed the connection mid-response")

    async def _open(self) -> None:
        self.close()
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._conn = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = self._conn = None
