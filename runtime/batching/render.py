"""The text a step owes its callers: the tokens a step accepted are rendered (detokenized, stop strings matched)
and handed to their requests' handles in order, then the handles of ended requests are closed.

The executor (runtime/batching/executor.py) renders at the end of its postprocess, or with `overlap` while the
next step's engine call runs on another thread: on a GPU the host's text work then costs the device nothing.
Rendering ends nothing: `run` returns the sequences whose text completed a stop string, and the executor ends
them (found late, one step after their token was accepted: it drops what was computed for them since), so callers
see the same tokens and text either way."""
from __future__ import annotations

from runtime.batching.handle import Output, RequestHandle
from runtime.request.sequence import Sequence

CLOSE = -1  # an owed entry's count that closes the handle instead


class Renderer:
    """What is owed, in order: (sequence, handle, first output index, count) or a close (count CLOSE). Used
    only by the executor's thread."""

    def __init__(self):
        self._owed: list[tuple[Sequence, RequestHandle, int, int]] = []
        self._dropped = 0  # tokens accepted after a stop string, dropped

    def owe(self, seq: Sequence, handle: RequestHandle, first: int, count: int) -> None:
        self._owed.append((seq, handle, first, count))

    def close(self, seq: Sequence, handle: RequestHandle) -> None:
        self._owed.append((seq, handle, 0, CLOSE))

    def run(self) -> list[Sequence]:
        """Render and hand over everything owed so far; returns the sequences whose text completed a stop string
        in it (for the executor to end)."""
        if not self._owed:
            return []
        owed, self._owed = self._owed, []
        stopped = []
        for seq, handle, first, count in owed:
            if count == CLOSE:  # an ended sequence runs no more: its tokens past a stop can go before the caller reads
                self.drop_after_stop(seq)
                handle._close()
                continue
            running = seq.stopped_at is None
            for index in range(first, first + count):
                if seq.stopped_at is not None:
                    break
                handle._emit(Output(seq.output_ids[index], seq.render(index)))
            if running and seq.stopped_at is not None:
                stopped.append(seq)
        return stopped

    def drop_after_stop(self, seq: Sequence) -> None:
        """Drop the tokens `seq` accepted after the one that completed its stop string (counted for take_dropped)."""
        self._dropped += seq.drop_after_stop()

    def take_dropped(self) -> int:
        dropped, self._dropped = self._dropped, 0
        return dropped
