"""What a caller holds for one request: its handle (streams Output events, cancels, waits for the Completion),
fed by the executor's thread (runtime/batching/executor.py)."""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from runtime.request.sequence import Sequence


@dataclass
class Output:
    """One generated token and the text it completed (may be empty while a character is incomplete)."""

    token_id: int
    text: str


@dataclass
class Completion:
    """The result of one request."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    metrics: dict | None = None
    error: str | None = None
    logprobs: list | None = None  # TokenLogprob per generated token (SamplingParams.logprobs), runtime/request/logprobs.py
    prompt_logprobs: list | None = None  # TokenLogprob | None per prompt token (SamplingParams.prompt_logprobs)


class RequestHandle:
    """Streams a request's tokens (plain or async iteration), can cancel it, and ends with a
    finish reason: stop, length, cancelled or error.

    `listener`: when given, every event goes to listener(output) on the executor thread instead of the
    handle's own queue, then listener(None) once the request has ended (runtime/async_engine.py fills its
    event loop's mailbox this way, emptied by an Executor step listener); it must return at once and not
    raise."""

    def __init__(self, seq: Sequence, executor,  # the Executor that serves it (runtime/batching/executor.py)
                 listener: Callable[[Output | None], None] | None = None):
        self.seq, self._executor, self._listener = seq, executor, listener
        self._events: queue.SimpleQueue[Output | None] = queue.SimpleQueue()  # C put/get: no lock in Python
        self._done = threading.Event()

    @property
    def id(self) -> int:
        return self.seq.id

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason if self._done.is_set() else None

    def cancel(self) -> None:
        self._executor.cancel(self)

    def __iter__(self) -> Iterator[Output]:
        while (event := self._events.get()) is not None:
            yield event

    async def __aiter__(self) -> AsyncIterator[Output]:
        loop = asyncio.get_running_loop()
        while (event := await loop.run_in_executor(None, self._events.get)) is not None:
            yield event

    def text_stream(self) -> Iterator[str]:
        return (o.text for o in self if o.text)

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        s = self.seq
        logprobs, prompt_logprobs = (None, None) if s.scores is None else s.scores.results(len(s.output_ids))
        return Completion(s.text, list(s.output_ids), len(s.prompt_ids), s.finish_reason, s.metrics(), s.error,
                          logprobs, prompt_logprobs)

    def _emit(self, output: Output) -> None:
        (self._listener or self._events.put)(output)

    def _close(self) -> None:
        self._done.set()
        (self._listener or self._events.put)(None)
