"""LoRA on a pipeline-parallel engine (an engine built with `lora:`): rank 0 owns the one AdapterPool
(runtime/lora/pool.py) the schedulers reserve slots in and the requests name, as on one engine; each stage's
graph has its own layers' LoRA branches, so each stage process holds only its layers' A/B inputs. Rank 0 sends
every row's slot with each step (StageStep.adapters), and the slots the pool wrote since the last step that sent
them (an adapter placed there, or unloaded) with the next step (`StageStep.new_slots`), each stage process
those slots' blocks of its own A/B in one message right after the step: a stage runs every step on the adapters
rank 0 saw when it sent it, and an adapter swap moves one slot's rank block per linear, not the whole inputs.

`RangePool` is the pool seen from one micro-batch's executor (runtime/parallel/virtual_engines.py): its rows
offset to the executor's KV slots, and no adapter another executor's sequences still use evicted."""
from __future__ import annotations

import datetime

import numpy as np
import torch

from runtime.lora.pool import AdapterPool
from runtime.manifest.types import PipelineParallel

INPUTS = ("lora_a.", "lora_b.")  # builder/passes/add_lora.py: the adapters' stacked A and B of each linear


def stage_inputs(section: PipelineParallel, rank: int) -> list[str]:
    """The A/B input names the segments of process `rank` (a stage's, 1..) read, in the order they are sent."""
    stage, tp_rank = section.place(rank)
    segments = section.stages[stage].ranks[tp_rank].segments
    return sorted({name for s in segments for name in s.inputs if name.startswith(INPUTS)})


def slot_block(name: str, shape, slot: int, slots: int) -> tuple[slice, slice]:
    """Slot `slot`'s block of A/B input `name` of `shape`: A [in, slots * r]'s rank columns, B [slots * r, out]'s
    rank rows (AdapterPool's layout: slot s >= 1 in rank block s - 1)."""
    axis = 1 if name.startswith(INPUTS[0]) else 0
    width = shape[axis] // slots
    ranks = slice((slot - 1) * width, slot * width)
    return (slice(None), ranks) if axis else (ranks, slice(None))


class AdapterSender:
    """Rank 0: the rows' slots and the changed slots' A/B blocks of each stage process's layers."""

    def __init__(self, pool: AdapterPool, section: PipelineParallel):
        self.pool = pool
        self.inputs = {rank: stage_inputs(section, rank) for rank in range(1, section.world)}

    def rows(self, start: int, rows: int) -> np.ndarray:
        """Each row's adapter slot in a call on KV rows [start, start + rows)."""
        return self.pool.rows[start:start + rows].copy()

    def changed(self) -> tuple[int, ...]:
        """The slots written since the last call: the step about to go out carries their blocks."""
        return tuple(self.pool.take_changed())

    def post(self, slots: tuple[int, ...], group, tag: int) -> list:
        """Post each stage process the blocks of `slots` of its A/B, flat in one float32 tensor (a copy: a later
        placement rewrites the pool's arrays, and is sent with a later step); returns the works and tensors."""
        posted, arrays, count = [], self.pool.arrays, self.pool.lora.max_adapters
        for rank, names in self.inputs.items():
            parts = [arrays[n][slot_block(n, arrays[n].shape, slot, count)].ravel() for slot in slots for n in names]
            tensor = torch.from_numpy(np.concatenate(parts))
            posted.append((group.send([tensor], rank, tag), tensor))
        return posted


class StageAdapters:
    """A stage process's A/B inputs: zeros until rank 0 sends a slot's blocks, kept where the sessions read them
    (bound by address into every call shape, `tensors`) and written in place."""

    def __init__(self, names: list[str], shapes: dict[str, list[int]], slots: int, device: torch.device):
        self.tensors = {name: torch.zeros(shapes[name], dtype=torch.float32, device=device) for name in names}
        self.slots = slots  # the engine's lora.max_adapters

    def receive(self, slots: tuple[int, ...], group, tag: int, timeout: datetime.timedelta) -> None:
        """Rank 0's blocks of `slots` (in AdapterSender.post's order) into the bound tensors; gloo receives
        into host memory, copied to the device when the tensors are there."""
        blocks = [(t, slot_block(n, t.shape, slot, self.slots)) for slot in slots for n, t in self.tensors.items()]
        sizes = [t[block].numel() for t, block in blocks]
        flat = torch.empty(sum(sizes), dtype=torch.float32)
        group.recv([flat], 0, tag).wait(timeout)
        for (tensor, block), part in zip(blocks, flat.split(sizes)):
            tensor[block] = part.view(tensor[block].shape).to(tensor.device)
        if any(t.is_cuda for t in self.tensors.values()):  # written on torch's stream, read on ONNX Runtime's
            torch.cuda.synchronize()


class RangePool:
    """`pool` as one virtual engine's scheduler sees it: KV row r is the runner's row `lo + r`; a slot is taken
    only from an adapter no submitted, unfinished sequence uses (any executor's: they share the slots, and another
    executor's running list is not this one's)."""

    def __init__(self, pool: AdapterPool, lo: int):
        self.pool, self.lo = pool, lo

    def __getattr__(self, name: str):
        return getattr(self.pool, name)

    def assign(self, row: int, name: str | None) -> None:
        self.pool.assign(self.lo + row, name)

    def reserve(self, name: str | None, running: list) -> bool:
        return self.pool.reserve(name, running + self.pool.unfinished())
