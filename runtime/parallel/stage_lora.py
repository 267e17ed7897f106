"""LoRA on a pipeline-parallel engine (an engine built with `lora:`): rank 0 owns the one AdapterPool
(runtime/lora/pool.py) the schedulers reserve slots in and the requests name, as on one engine; each stage's
graph has its own layers' LoRA branches, so each stage process holds only its layers' A/B inputs. Rank 0 sends
every row's slot with each step (StageStep.adapters), and, when the pool changed since the last step that sent
them (an adapter loaded, placed in a slot or unloaded), each stage's A/B right after that step
(`StageStep.new_adapters`): a stage runs the step on the adapters rank 0 saw when it sent it, in step order.

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


class AdapterSender:
    """Rank 0: the pool's A/B of each stage process's layers, posted after a step when the pool changed."""

    def __init__(self, pool: AdapterPool, section: PipelineParallel):
        self.pool, self.sent = pool, pool.version
        self.inputs = {rank: stage_inputs(section, rank) for rank in range(1, section.world)}

    def changed(self) -> bool:
        return self.pool.version != self.sent

    def post(self, group, tag: int) -> list:
        """Post every stage its A/B as they are now (copies: a later load rewrites the pool's arrays); returns the
        works and the tensors they send."""
        self.sent = self.pool.version  # read first: a change while copying bumps it again and is sent next step
        posted = []
        for rank, names in self.inputs.items():
            for name in names:
                tensor = torch.from_numpy(self.pool.arrays[name].copy())
                posted.append((group.send([tensor], rank, tag), tensor))
        return posted

    def rows(self, start: int, rows: int) -> np.ndarray:
        """Each row's adapter slot in a call on KV rows [start, start + rows)."""
        return self.pool.rows[start:start + rows].copy()


class StageAdapters:
    """A stage process's A/B inputs: zeros until rank 0 sends some, kept where the sessions read them (bound by
    address into every call shape, `tensors`) and received in place."""

    def __init__(self, names: list[str], shapes: dict[str, list[int]], device: torch.device):
        self.tensors = {name: torch.zeros(shapes[name], dtype=torch.float32, device=device) for name in names}
        self._host = {name: t if t.device.type == "cpu" else torch.zeros(t.shape, dtype=torch.float32)
                      for name, t in self.tensors.items()}  # gloo receives into host memory

    def receive(self, group, tag: int, timeout: datetime.timedelta) -> None:
        """Rank 0's A/B for this stage, in `stage_inputs` order, into the bound tensors."""
        for name, tensor in self.tensors.items():
            host = self._host[name]
            group.recv([host], 0, tag).wait(timeout)
            if host is not tensor:
                tensor.copy_(host)
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
