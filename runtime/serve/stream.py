"""A streaming answer's way out: the outputs of a request's choices merged as they come, and EventStream,
which sends their server-sent events straight to ASGI and stops the stream when the client disconnects."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.responses import StreamingResponse

from runtime.async_engine import AsyncRequest


async def merged(requests: list[AsyncRequest]) -> AsyncIterator[list[tuple[int, str | None, int]]]:
    """What is ready, as it comes: a list of (choice index, text of its outputs ready, how many outputs: tokens)
    and (index, None, 0) when a choice has ended. Outputs that queued up while the client was being written to
    come as one text; a choice's end delivered with its last outputs comes in the same list."""
    if len(requests) == 1:
        request = requests[0]
        while batch := await request.next_batch():
            text = "".join(o.text for o in batch)
            if request.exhausted:
                yield [(0, text, len(batch)), (0, None, 0)]
                return
            yield [(0, text, len(batch))]
        yield [(0, None, 0)]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, request: AsyncRequest) -> None:
        while batch := await request.next_batch():
            queue.put_nowait((i, "".join(o.text for o in batch), len(batch)))
        queue.put_nowait((i, None, 0))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        ended = 0
        while ended < len(requests):
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            ended += sum(text is None for _, text, _ in ready)
            yield ready
    finally:
        for task in tasks:
            task.cancel()


class EventStream(StreamingResponse):
    """A text/event-stream response of the byte events its generator yields. Where Starlette runs each
    stream in a task group with a disconnect listener, this one watches for the disconnect in one plain
    task that cancels the sending; however the stream ends, its generator is closed at once (a client
    gone cancels its requests then, not when the generator is garbage-collected)."""

    def __init__(self, events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        sending, gone = asyncio.current_task(), asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            sending.cancel()

        watcher = asyncio.create_task(watch())
        try:
            async for event in self.body_iterator:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone.is_set():  # cancelled from outside (shutdown): not ours to absorb
                raise
            sending.uncancel()  # the client left: the response ends here
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()
