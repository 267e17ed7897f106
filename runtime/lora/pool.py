"""AdapterPool: the one owner of an engine's loaded LoRA adapters. It holds the stacked A/B arrays the engine
reads as inputs (slot 0 zeros: the base model, slots 1..max_adapters the loaded adapters), which adapter each
name occupies, each KV row's slot (written as a step's calls run: the tokens of a row use its adapter), and the
sequences running on each adapter (an unload waits for them)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from runtime.lora.adapters import AdapterError, read_adapter
from runtime.manifest.types import Lora


class AdapterPool:
    """Adapters by name in the engine's `max_adapters` device slots; `arrays` (input name -> float32 array) and
    `version` (bumped on every change) are what a runner copies to its inputs."""

    def __init__(self, lora: Lora, rows: int):
        self.lora = lora
        slots = lora.max_adapters + 1
        self.arrays: dict[str, np.ndarray] = {}
        for lin in lora.linears:
            width = len(lin.modules) * lora.max_rank
            self.arrays[lin.a] = np.zeros((slots, lin.in_features, width), np.float32)
            self.arrays[lin.b] = np.zeros((slots, width, sum(lin.widths)), np.float32)
        self.rows = np.zeros(rows, np.int64)  # KV row -> its sequence's slot (0: base)
        self.version = 0
        self._slots: dict[str, int] = {}
        self._draining: set[str] = set()
        self._users: dict[str, list] = {}  # name -> sequences submitted on it (finished ones dropped lazily)
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        """The adapters requests may name, in load order."""
        with self._lock:
            return [n for n in self._slots if n not in self._draining]

    def load(self, name: str, path: str | Path) -> None:
        """Read the PEFT adapter at `path` into a free slot; refuses a taken name or a full pool by name."""
        if not isinstance(name, str) or not name:
            raise AdapterError(f"adapter name must be a non-empty string, not {name!r}")
        adapter = read_adapter(name, path, self.lora)  # before any change: a refused adapter loses nothing
        with self._lock:
            if name in self._slots:
                raise AdapterError(f"adapter {name!r} is already loaded; unload it first (loaded: {list(self._slots)})")
            free = sorted(set(range(1, self.lora.max_adapters + 1)) - set(self._slots.values()))
            if not free:
                raise AdapterError(f"adapter {name!r}: all {self.lora.max_adapters} adapter slots (lora.max_adapters) "
                                   f"are taken by {list(self._slots)}; unload one first")
            slot = free[0]
            for input_a, (a, b) in adapter.weights.items():
                self.arrays[input_a][slot] = a
                self.arrays[input_a.replace("lora_a.", "lora_b.", 1)][slot] = b
            self._slots[name] = slot
            self.version += 1

    def slot_of(self, name: str | None) -> int:
        """The slot a request on adapter `name` runs in (None: the base model, 0)."""
        if name is None:
            return 0
        with self._lock:
            if name not in self._slots or name in self._draining:
                raise ValueError(f"adapter {name!r} is not loaded; loaded adapters: "
                                 f"{[n for n in self._slots if n not in self._draining]}")
            return self._slots[name]

    def track(self, seq) -> None:
        """`seq` runs on its adapter until it finishes (an unload of that adapter waits for it)."""
        name = seq.params.adapter
        if name is not None:
            self.slot_of(name)  # refuses an unknown or unloading adapter
            with self._lock:
                self._users.setdefault(name, []).append(seq)

    def assign(self, row: int, name: str | None) -> None:
        """KV row `row` runs a sequence on adapter `name` from this call on (the engine thread's call)."""
        with self._lock:
            self.rows[row] = 0 if name is None else self._slots.get(name, 0)

    def unload(self, name: str, timeout: float | None = None) -> None:
        """Stop taking requests on `name`, wait for those running on it to finish, then free its slot."""
        with self._lock:
            if name not in self._slots:
                raise ValueError(f"adapter {name!r} is not loaded; loaded adapters: {list(self._slots)}")
            self._draining.add(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._running(name):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"adapter {name!r}: requests still running after {timeout} s")
            time.sleep(0.005)
        with self._lock:
            slot = self._slots.pop(name)
            self._draining.discard(name)
            self._users.pop(name, None)
            for lin in self.lora.linears:
                self.arrays[lin.a][slot] = 0
                self.arrays[lin.b][slot] = 0
            self.version += 1

    def _running(self, name: str) -> bool:
        with self._lock:
            users = self._users[name] = [s for s in self._users.get(name, []) if not s.finished]
            return bool(users)
