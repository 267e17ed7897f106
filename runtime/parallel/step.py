"""The step rank 0 sends every worker rank: a small typed record (`Step`) with `to_tensor`/`from_tensor`, and
the two broadcasts that carry it (a fixed-size header, then the token ids, lengths and KV copies it sizes).
Rank 0 (runtime/parallel/runner.py) sends; the workers (runtime/parallel/worker.py) receive."""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

RUN, STOP = 1, 2
HEADER = 6  # op, start, rows, seq, total_len, number of KV copies
RELEASED = -1  # a KV copy from this source slot: hand the slot's pages from token `length` on back instead (KVCache.release_row)
Broadcast = Callable[..., None]  # RankEngine.broadcast(tensor, timeout=None): rank 0's tensor into everyone's


@dataclass(frozen=True)
class Step:
    """One call every rank runs on its shard, or the order to stop (`stop`).

    `start`: the first KV slot of the call's rows; `ids` int64 [rows, seq]; `seqlens` [rows] each row's total
    length - 1; `total_len` the batch's longest total length; `copies` (source slot, slot, length): KV prefix
    copies rank 0 made since the last step (or rows it handed back: source RELEASED), which every rank replays
    before running."""

    start: int = 0
    ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    seqlens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    total_len: int = 0
    copies: tuple[tuple[int, int, int], ...] = ()
    stop: bool = False

    def to_tensor(self) -> torch.Tensor:
        """int64 [HEADER + rows * seq + rows + 3 * copies]: the header, then ids, seqlens and copies flat."""
        rows, seq = self.ids.shape
        header = [STOP if self.stop else RUN, self.start, rows, seq, self.total_len, len(self.copies)]
        return torch.from_numpy(np.concatenate([np.asarray(header, np.int64), np.asarray(self.ids, np.int64).ravel(),
                                                np.asarray(self.seqlens, np.int64),
                                                np.asarray(self.copies, np.int64).reshape(-1)]))

    @staticmethod
    def payload_size(header: torch.Tensor) -> int:
        """How many values follow a header (none after STOP)."""
        op, _, rows, seq, _, copies = header.tolist()
        return 0 if op == STOP else rows * seq + rows + 3 * copies

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Step:
        values = tensor.numpy()
        op, start, rows, seq, total, copies = values[:HEADER].tolist()
        if op == STOP:
            return cls(stop=True)
        ids_end = HEADER + rows * seq
        return cls(start, values[HEADER:ids_end].reshape(rows, seq), values[ids_end:ids_end + rows], total,
                   tuple(tuple(c) for c in values[ids_end + rows:].reshape(-1, 3).tolist()))


def send(step: Step, broadcast: Broadcast) -> None:
    """Rank 0: the header, then (unless stopping) the rest."""
    tensor = step.to_tensor()
    broadcast(tensor[:HEADER])
    if not step.stop:
        broadcast(tensor[HEADER:])


def receive(broadcast: Broadcast, idle: datetime.timedelta) -> Step:
    """A worker: wait up to `idle` for rank 0's next header, then receive the values it sizes."""
    header = torch.zeros(HEADER, dtype=torch.int64)
    broadcast(header, idle)
    payload = torch.zeros(Step.payload_size(header), dtype=torch.int64)
    if header[0] != STOP:
        broadcast(payload)
    return Step.from_tensor(torch.cat([header, payload]))
