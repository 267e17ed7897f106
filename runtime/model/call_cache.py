"""CallCache: the bound buffers of the most recently used call shapes, shared by the one-session runner
(runtime/model/model_runner.py) and a tensor-parallel rank (runtime/parallel/rank.py). Decode and verify
shapes recur and keep their buffers; prompt shapes vary, and the least recently used are dropped."""
from __future__ import annotations

from typing import Callable, Hashable, TypeVar

MAX_CALLS = 64  # call shapes whose buffers stay bound

Call = TypeVar("Call")


class CallCache(dict):
    """call shape -> its bound call, most recently used last; `made` counts the calls bound so far (a call
    that binds a new shape is slower than the next of its shape)."""

    def __init__(self, limit: int = MAX_CALLS):
        super().__init__()
        self.limit, self.made = limit, 0

    def use(self, key: Hashable, make: Callable[[], Call]) -> Call:
        """The call bound for `key`, made by `make()` the first time (or again after it was dropped)."""
        call = self.pop(key, None)
        if call is None:
            call = make()
            self.made += 1
        self[key] = call
        if len(self) > self.limit:
            del self[next(iter(self))]
        return call
