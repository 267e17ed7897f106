"""The embeddable API in asyncio form: submit, async-iterate outputs, cancel, await the result.

The executor thread posts each event to its loop's Mailbox, which wakes the loop once per executor step
for all of the step's events, not once per token (and once for several steps when the loop is behind). Cancelling the task that awaits a request's next output cancels the
request, which frees its KV slot at the executor's next step. Blocking work (tokenization, the chat
template) runs in a worker thread, never on the event loop."""
from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence as Seq

from runtime.engine import LLM
from runtime.batching.executor import Completion, Output, RequestHandle
from runtime.request.params import SamplingParams
from runtime.request.sequence import Sequence
from runtime.speculation.speculator import Speculation


class Mailbox:
    """Events from executor threads to one event loop's requests, delivered in batches: each executor step's
    events wait here until the step ends (Executor.add_step_listener), then one wake-up of the loop
    delivers them all (and whatever other steps posted before the loop got to them)."""

    _by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop, self._lock = loop, threading.Lock()
        self._posted: list[tuple[AsyncRequest, Output | None]] = []
        self._scheduled = False  # a delivery is due on the loop
        self._executors: weakref.WeakSet = weakref.WeakSet()  # those that flush here after each step

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop, executor) -> Mailbox:
        """The loop's mailbox, flushed after each step of `executor` (runs on the loop)."""
        box = cls._by_loop.get(loop)
        if box is None:
            box = cls._by_loop[loop] = cls(loop)
        if executor not in box._executors:
            box._executors.add(executor)
            executor.add_step_listener(box.flush)
        return box

    def post(self, request: AsyncRequest, event: Output | None) -> None:
        """Runs on the executor thread."""
        with self._lock:
            self._posted.append((request, event))

    def flush(self) -> None:
        """Runs on the executor thread after each step: wake the loop if events wait and no wake-up is due."""
        with self._lock:
            if not self._posted or self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody awaits these requests any more
            for request, _ in self._take():
                request.handle.cancel()

    def _take(self) -> list[tuple[AsyncRequest, Output | None]]:
        with self._lock:
            posted, self._posted, self._scheduled = self._posted, [], False
        return posted

    def _deliver(self) -> None:
        for request, event in self._take():
            request._receive(event)


class AsyncRequest:
    """One submitted request: `async for output in request` yields Output(token_id, text) until it
    ends; `await request.result()` gives the Completion; `request.cancel()` stops it.
    As an async context manager it cancels the request on exit unless it has ended."""

    def __init__(self, executor, seq: Sequence):
        self._loop = asyncio.get_running_loop()
        self._mailbox = Mailbox.of(self._loop, executor)
        self._events: deque[Output | None] = deque()
        self._waiter: asyncio.Future | None = None  # set while a task awaits the next event
        self._ended = False  # iteration has reached the end
        self._over = self._loop.create_future()  # done when the executor has ended the request
        self.handle: RequestHandle = executor.submit_sequence(seq, listener=self._on_event)

    def _on_event(self, event: Output | None) -> None:
        """Runs on the executor thread."""
        self._mailbox.post(self, event)

    def _receive(self, event: Output | None) -> None:
        """Runs on the loop."""
        self._events.append(event)
        if event is None and not self._over.done():
            self._over.set_result(None)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def id(self) -> int:
        return self.handle.id

    @property
    def prompt_tokens(self) -> int:
        return len(self.handle.seq.prompt_ids)

    def cancel(self) -> None:
        """Cancel the request (its KV slot is freed at the executor's next step); iteration then ends."""
        if not self._over.done():
            self.handle.cancel()

    @property
    def exhausted(self) -> bool:
        """Iteration has reached the end: no output follows."""
        return self._ended

    def add_done_callback(self, callback: Callable[[AsyncRequest], None]) -> None:
        """callback(request) on the loop once the executor has ended the request (its outputs may not
        all be iterated yet)."""
        self._over.add_done_callback(lambda _: callback(self))

    def __aiter__(self) -> AsyncIterator[Output]:
        return self

    async def __anext__(self) -> Output:
        batch = await self.next_batch(1)
        if not batch:
            raise StopAsyncIteration
        return batch[0]

    async def next_batch(self, most: int | None = None) -> list[Output]:
        """The next output and every one already delivered behind it, up to `most` ([] once the request
        has ended): a streaming server sends them as one chunk when it falls behind the executor."""
        if self._ended:
            return []
        if not self._events:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            except asyncio.CancelledError:  # the awaiting task was cancelled: so is the request
                self.cancel()
                raise
            finally:
                self._waiter = None
        batch = []
        while self._events and (most is None or len(batch) < most):
            event = self._events.popleft()
            if event is None:
                self._ended = True
                break
            batch.append(event)
        return batch

    async def ended(self) -> Completion:
        """Wait for the end without consuming outputs (another task may be iterating them)."""
        await asyncio.shield(self._over)
        return self.handle.result(timeout=0)

    async def result(self) -> Completion:
        """Wait for the end (consuming any outputs not yet iterated) and return the Completion."""
        while await self.next_batch():
            pass
        return self.handle.result(timeout=0)

    async def __aenter__(self) -> AsyncRequest:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncLLM:
    """An LLM served to asyncio code. Every method is a coroutine that never blocks the event loop."""

    def __init__(self, llm: LLM):
        self.llm = llm

    @classmethod
    async def load(cls, engine_dir: str | Path, **options) -> AsyncLLM:
        """Load an engine in a worker thread; `options` as for LLM."""
        return cls(await asyncio.to_thread(LLM, engine_dir, **options))

    async def submit(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                     speculation: Speculation | None = None) -> AsyncRequest:
        """Validate (RequestError before any work) and queue one request."""
        seq = await asyncio.to_thread(self.llm.make_sequence, prompt, params, speculation)
        return self.submit_sequence(seq)

    def submit_sequence(self, seq: Sequence) -> AsyncRequest:
        """Queue a sequence already validated with `llm.make_sequence` (run that off the loop)."""
        return AsyncRequest(self.llm.executor, seq)

    async def generate(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                       speculation: Speculation | None = None) -> Completion:
        request = await self.submit(prompt, params, speculation)
        async with request:
            return await request.result()

    async def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                     speculation: Speculation | None = None) -> AsyncIterator[str]:
        """Text deltas for one prompt; closing the generator early cancels the request."""
        request = await self.submit(prompt, params, speculation)
        async with request:
            async for output in request:
                if output.text:
                    yield output.text

    async def encode(self, prompt: str | Seq[int]) -> list[int]:
        return await asyncio.to_thread(self.llm.encode, prompt)

    async def apply_chat_template(self, messages: list[dict]) -> str:
        return await asyncio.to_thread(self.llm.apply_chat_template, messages)

    async def chat_prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return await asyncio.to_thread(self.llm.chat_prompt_ids, messages, True, tools)

    async def stats(self) -> dict:
        """The executor's queue depth, running rows, free KV slots and totals."""
        return await asyncio.to_thread(self.llm.executor.stats)

    async def close(self) -> None:
        await asyncio.to_thread(self.llm.close)
