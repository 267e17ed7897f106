"""The step rank 0 sends every pipeline stage: a small typed record (`StageStep`) with `to_tensor`/`from_tensor`,
sent point to point (a fixed-size header, then the values it sizes) so that rank 0 never waits for a stage that
is still busy with an earlier micro-batch: the sends are posted, and completed when the stage takes them.
Rank 0 (runtime/parallel/pipeline_runner.py) sends; the stages (runtime/parallel/stage.py) receive."""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import numpy as np
import torch

RUN, STOP = 1, 2
HEADER = 10  # op, start, rows, seq, total_len, logits rows, number of KV copies, head, adapter slots, new slots
LOGITS, NEXT_TOKEN = 0, 1  # what the last stage returns: float32 logits [n, vocab], or int64 ids [n] (their ArgMax)
TAG = 0  # every message between two ranks goes in order on one tag


@dataclass(frozen=True)
class StageStep:
    """One micro-batch every stage runs on its layers, or the order to stop (`stop`).

    `start`: the first KV slot of the call's rows; `ids` int64 [rows, seq] (read by the first stage);
    `seqlens` [rows] each row's total length - 1; `total_len` the batch's longest total length; `index` the
    flat positions whose logits the last stage returns; `copies` (source slot, slot, length): KV prefix copies
    (or, from source RELEASED, rows handed back) rank 0's slot table made since the last step, which every
    stage replays on its own layers before running. `head`: LOGITS, or NEXT_TOKEN (greedy rows: the last stage
    returns the ids alone). An engine built with `lora:` (runtime/parallel/stage_lora.py): `adapters` int64 [rows]
    each row's adapter slot (0: the base model; empty without LoRA); `new_slots` the slots whose A/B blocks follow
    the step (an adapter placed there, or unloaded, since the last step that sent them)."""

    start: int = 0
    ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    seqlens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    total_len: int = 0
    index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    copies: tuple[tuple[int, int, int], ...] = ()
    head: int = LOGITS
    adapters: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    new_slots: tuple[int, ...] = ()
    stop: bool = False

    def to_tensor(self) -> torch.Tensor:
        """int64 [HEADER + rows * seq + rows + n + 3 * copies + adapters + new slots]: the header, then ids,
        seqlens, index, copies, adapter slots, new slots."""
        rows, seq = self.ids.shape
        header = [STOP if self.stop else RUN, self.start, rows, seq, self.total_len, len(self.index), len(self.copies),
                  self.head, len(self.adapters), len(self.new_slots)]
        parts = [header, np.asarray(self.ids, np.int64).ravel(), np.asarray(self.seqlens, np.int64),
                 np.asarray(self.index, np.int64), np.asarray(self.copies, np.int64).reshape(-1),
                 np.asarray(self.adapters, np.int64), np.asarray(self.new_slots, np.int64)]
        return torch.from_numpy(np.concatenate([np.asarray(p, np.int64) for p in parts]))

    @staticmethod
    def payload_size(header: torch.Tensor) -> int:
        op, _, rows, seq, _, n, copies, _, adapters, slots = header.tolist()
        return 0 if op == STOP else rows * seq + rows + n + 3 * copies + adapters + slots

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> StageStep:
        values = tensor.numpy()
        op, start, rows, seq, total, n, copies, head, adapters, slots = values[:HEADER].tolist()
        if op == STOP:
            return cls(stop=True)
        at = np.cumsum([HEADER, rows * seq, rows, n, 3 * copies, adapters, slots]).tolist()
        return cls(start, values[at[0]:at[1]].reshape(rows, seq), values[at[1]:at[2]], total, values[at[2]:at[3]],
                   tuple(tuple(c) for c in values[at[3]:at[4]].reshape(-1, 3).tolist()), head, values[at[4]:at[5]],
                   tuple(values[at[5]:at[6]].tolist()))


def post(step: StageStep, group, rank: int) -> list:
    """Rank 0: post the step's header and payload to `rank` without waiting; returns the works and the tensors
    they send (keep them until the works complete)."""
    tensor = step.to_tensor()
    parts = [tensor[:HEADER].clone()] + ([] if step.stop else [tensor[HEADER:].clone()])
    return [(group.send([p], rank, TAG), p) for p in parts if p.numel()]


def receive(group, timeout: datetime.timedelta) -> StageStep:
    """A stage: wait up to `timeout` for rank 0's next header, then receive the values it sizes."""
    header = torch.zeros(HEADER, dtype=torch.int64)
    group.recv([header], 0, TAG).wait(timeout)
    payload = torch.zeros(StageStep.payload_size(header), dtype=torch.int64)
    if payload.numel():
        group.recv([payload], 0, TAG).wait(timeout)
    return StageStep.from_tensor(torch.cat([header, payload]))
