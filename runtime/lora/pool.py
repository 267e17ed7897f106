"""AdapterPool: the one owner of an engine's loaded LoRA adapters. Every loaded adapter is kept on the host; the
`max_adapters` device slots hold the most recently used ones, in the A/B arrays the engine reads as inputs, laid
out for its GEMMs: A [in, max_adapters * r] and B [max_adapters * r, out], slot s >= 1 in rank block s - 1 (slot 0,
the base model, has none). The scheduler admits a sequence only once its adapter has a slot (`reserve`:
a free slot, or the least recently used adapter no running sequence uses is evicted to the host), so a request
waits for a slot and never fails for want of one. The pool also keeps each KV row's slot (written as a step's
calls run: the tokens of a row use its adapter) and the sequences submitted on each adapter (an unload waits
for them)."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from runtime.lora.adapters import Adapter, AdapterError, read_adapter
from runtime.manifest.types import Lora


class AdapterPool:
    """Adapters by name in the engine's `max_adapters` device slots; `arrays` (input name -> float32 array) and
    `version` (bumped on every change) are what a runner copies to its inputs."""

    def __init__(self, lora: Lora, rows: int):
        self.lora = lora
        self.arrays: dict[str, np.ndarray] = {}
        for lin in lora.linears:
            width = lora.max_adapters * len(lin.modules) * lora.max_rank
            self.arrays[lin.a] = np.zeros((lin.in_features, width), np.float32)
            self.arrays[lin.b] = np.zeros((width, sum(lin.widths)), np.float32)
        self.rows = np.zeros(rows, np.int64)  # KV row -> its sequence's slot (0: base)
        self.version = 0
        self._changed: set[int] = set()  # slots written since the last `take_changed`
        self._host: dict[str, Adapter] = {}  # every loaded adapter, in load order
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recently reserved first
        self._draining: set[str] = set()
        self._users: dict[str, list] = {}  # name -> sequences submitted on it (finished ones dropped lazily)
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        """The adapters requests may name, in load order."""
        with self._lock:
            return [n for n in self._host if n not in self._draining]

    @property
    def resident(self) -> list[str]:
        """The adapters in device slots now, least recently used first."""
        with self._lock:
            return list(self._slots)

    def load(self, name: str, path: str | Path) -> None:
        """Read the PEFT adapter at `path` (into a free slot when there is one, else kept on the host until a
        request needs it); refuses a taken name."""
        if not isinstance(name, str) or not name:
            raise AdapterError(f"adapter name must be a non-empty string, not {name!r}")
        adapter = read_adapter(name, path, self.lora)  # before any change: a refused adapter loses nothing
        with self._lock:
            if name in self._host:
                raise AdapterError(f"adapter {name!r} is already loaded; unload it first (loaded: {list(self._host)})")
            self._host[name] = adapter
            free = self._free_slots()
            if free:
                self._place(name, free[0])

    def reserve(self, name: str | None, running: list) -> bool:
        """Whether a sequence on adapter `name` may run now: it is resident (or the base), or gets a free slot,
        or the slot of the least recently used adapter that none of `running` uses. False: it waits."""
        if name is None:
            return True
        with self._lock:
            if name in self._slots:
                self._slots.move_to_end(name)
                return True
            if name not in self._host:
                return False  # unloaded while it waited: the executor's checks end it
            free = self._free_slots()
            if not free:
                busy = {s.params.adapter for s in running}
                idle = [n for n in self._slots if n not in busy]
                if not idle:
                    return False
                free = [self._slots.pop(idle[0])]
            self._place(name, free[0])
            return True

    def _free_slots(self) -> list[int]:
        return sorted(set(range(1, self.lora.max_adapters + 1)) - set(self._slots.values()))

    def _place(self, name: str, slot: int) -> None:
        """Write adapter `name`'s A and B into device slot `slot` (the lock held)."""
        self._clear(slot)
        for input_a, (a, b) in self._host[name].weights.items():
            block = self._block(slot, a.shape[1])
            self.arrays[input_a][:, block] = a
            self.arrays[input_a.replace("lora_a.", "lora_b.", 1)][block] = b
        self._slots[name] = slot
        self._changed.add(slot)
        self.version += 1

    def _clear(self, slot: int) -> None:
        for lin in self.lora.linears:
            block = self._block(slot, len(lin.modules) * self.lora.max_rank)
            self.arrays[lin.a][:, block] = 0
            self.arrays[lin.b][block] = 0

    @staticmethod
    def _block(slot: int, rank: int) -> slice:
        """Slot `slot`'s rank columns of A (rows of B): block slot - 1."""
        return slice((slot - 1) * rank, slot * rank)

    def take_changed(self) -> list[int]:
        """The slots whose A/B were written since the last call (a pipeline engine sends only those to its
        stages: runtime/parallel/stage_lora.py)."""
        with self._lock:
            changed, self._changed = sorted(self._changed), set()
        return changed

    def slot_of(self, name: str | None) -> int:
        """The slot adapter `name` is in now (None, the base model, or an adapter on the host only: 0); raises
        ValueError naming the loaded adapters when `name` is not one of them."""
        if name is None:
            return 0
        with self._lock:
            self._check_loaded(name)
            return self._slots.get(name, 0)

    def track(self, seq) -> None:
        """`seq`, queued on the executor, runs on its adapter until it finishes (an unload of that adapter waits
        for it; a sequence made but never queued is not waited for). Refuses an unknown or unloading adapter."""
        name = seq.params.adapter
        if name is not None:
            with self._lock:
                self._check_loaded(name)
                self._users.setdefault(name, []).append(seq)

    def _check_loaded(self, name: str) -> None:
        """ValueError naming the loaded adapters when `name` is not one of them (the lock held)."""
        if name not in self._host or name in self._draining:
            raise ValueError(f"adapter {name!r} is not loaded; loaded adapters: "
                             f"{[n for n in self._host if n not in self._draining]}")

    def unfinished(self) -> list:
        """The sequences submitted on an adapter (`track`) that have not finished."""
        with self._lock:
            return [s for users in self._users.values() for s in users if not s.finished]

    def assign(self, row: int, name: str | None) -> None:
        """KV row `row` runs a sequence on adapter `name` from this call on (the engine thread's call)."""
        with self._lock:
            self.rows[row] = 0 if name is None else self._slots.get(name, 0)

    def unload(self, name: str, timeout: float | None = None) -> None:
        """Stop taking requests on `name`, wait for those running on it to finish, then free its slot."""
        with self._lock:
            if name not in self._host:
                raise ValueError(f"adapter {name!r} is not loaded; loaded adapters: {list(self._host)}")
            self._draining.add(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._running(name):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"adapter {name!r}: requests still running after {timeout} s")
            time.sleep(0.005)
        with self._lock:
            del self._host[name]
            self._draining.discard(name)
            self._users.pop(name, None)
            slot = self._slots.pop(name, None)
            if slot is not None:
                self._clear(slot)
                self._changed.add(slot)
                self.version += 1

    def _running(self, name: str) -> bool:
        with self._lock:
            users = self._users[name] = [s for s in self._users.get(name, []) if not s.finished]
            return bool(users)
