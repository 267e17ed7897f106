"""The embeddable API in asyncio form: submit, async-iterate outputs, cancel, await the result.

The executor thread hands each event to the request's asyncio.Queue with loop.call_soon_threadsafe (no
thread per awaited event). Cancelling the task that awaits a request's next output cancels the request,
which frees its KV slot at the executor's next step. Blocking work (tokenization, the chat template)
runs in a worker thread, never on the event loop."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Sequence as Seq

from runtime.engine import LLM
from runtime.batching.executor import Completion, Output, RequestHandle
from runtime.request.params import SamplingParams
from runtime.request.sequence import Sequence
from runtime.speculation.speculator import Speculation


class AsyncRequest:
    """One submitted request: `async for output in request` yields Output(token_id, text) until it
    ends; `await request.result()` gives the Completion; `request.cancel()` stops it.
    As an async context manager it cancels the request on exit unless it has ended."""

    def __init__(self, executor, seq: Sequence):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Output | None] = asyncio.Queue()
        self._ended = False
        self._over = asyncio.Event()  # set when the executor has ended the request
        self.handle: RequestHandle = executor.submit_sequence(seq, listener=self._on_event)

    def _on_event(self, event: Output | None) -> None:
        """Runs on the executor thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
            if event is None:
                self._loop.call_soon_threadsafe(self._over.set)
        except RuntimeError:  # the loop is closed: nobody awaits this request any more
            if event is not None:
                self.handle.cancel()

    @property
    def id(self) -> int:
        return self.handle.id

    @property
    def prompt_tokens(self) -> int:
        return len(self.handle.seq.prompt_ids)

    def cancel(self) -> None:
        """Cancel the request (its KV slot is freed at the executor's next step); iteration then ends."""
        if not self._ended:
            self.handle.cancel()

    def __aiter__(self) -> AsyncIterator[Output]:
        return self

    async def __anext__(self) -> Output:
        if self._ended:
            raise StopAsyncIteration
        try:
            event = await self._queue.get()
        except asyncio.CancelledError:  # the awaiting task was cancelled: so is the request
            self.cancel()
            raise
        if event is None:
            self._ended = True
            raise StopAsyncIteration
        return event

    async def next_batch(self) -> list[Output]:
        """The next output and every one already queued behind it ([] once the request has ended):
        a streaming server sends them as one chunk when it falls behind the executor."""
        try:
            batch = [await self.__anext__()]
        except StopAsyncIteration:
            return []
        while not self._queue.empty():
            event = self._queue.get_nowait()
            if event is None:
                self._ended = True
                break
            batch.append(event)
        return batch

    async def ended(self) -> Completion:
        """Wait for the end without consuming outputs (another task may be iterating them)."""
        await self._over.wait()
        return self.handle.result(timeout=0)

    async def result(self) -> Completion:
        """Wait for the end (consuming any outputs not yet iterated) and return the Completion."""
        async for _ in self:
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

    async def stats(self) -> dict:
        """The executor's queue depth, running rows, free KV slots and totals."""
        return await asyncio.to_thread(self.llm.executor.stats)

    async def close(self) -> None:
        await asyncio.to_thread(self.llm.close)
