"""Micro-batching for a pipeline-parallel engine: P executors ("virtual engines", as vLLM calls them), one per
stage, each with its own scheduler over its own range of KV slots and its own thread. Each executor's step is
one micro-batch: while its call runs on stage s, another executor's runs on stage s - 1, so at P groups of
sequences in flight every stage works (a single executor would send one batch through the stages at a time:
each stage idle P - 1 steps of P). Requests go to the executor with the most free slots.

Every executor is the unchanged in-flight batching executor (runtime/batching/executor.py): prefill chunks,
preemption, prefix reuse (within its slots) and n-gram speculation work as on one engine. `VirtualEngines` has
the Executor's API (submit, cancel, stats, step observers and listeners, shutdown), summed over its executors."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np

from runtime.batching.block_table import BlockConfig
from runtime.batching.executor import Executor, RequestHandle
from runtime.config import ExecutorConfig
from runtime.manifest.arith import ceil_div
from runtime.model.runner import Runner
from runtime.parallel.stage_lora import RangePool
from runtime.request.sequence import Sequence


class SlotRange(Runner):
    """Slots [lo, hi) of a pipeline runner, as a runner of its own: slot 0 here is slot `lo` there."""

    def __init__(self, runner, lo: int, hi: int):
        spec = dataclasses.replace(runner.spec, slots=hi - lo)
        super().__init__(runner.engine_dir, runner.manifest, spec, _RangeCache(runner.cache, lo, spec))
        self.runner, self.lo = runner, lo
        self.prompt_buckets, self.has_next_token = runner.prompt_buckets, runner.has_next_token
        self.lora = RangePool(runner.lora, lo) if runner.lora is not None else None  # rows offset by lo

    @property
    def new_call_shapes(self) -> int:
        return self.runner.new_call_shapes

    def run(self, start: int, input_ids: np.ndarray, seqlens_k: np.ndarray, total_len: int,
            logits_index: np.ndarray, head: str = "logits"):
        return self.runner.run(self.lo + start, input_ids, seqlens_k, total_len, logits_index, head)


class _RangeCache:
    """The runner's slot recorder seen from a SlotRange: its slots offset by `lo`."""

    def __init__(self, cache, lo: int, spec):
        self.parent, self.lo, self.spec, self.device = cache, lo, spec, cache.device

    def copy_prefix(self, src: int, dst: int, tokens: int) -> None:
        self.parent.copy_prefix(self.lo + src, self.lo + dst, tokens)

    def release_row(self, slot: int, start: int = 0) -> None:
        self.parent.release_row(self.lo + slot, start)


class VirtualEngines:
    """`count` executors over disjoint slot ranges of `runner` (a PipelineRunner), each with its share of the
    KV blocks and of `max_running` (fewer executors where the slots or blocks do not go round: `micro_batches`)."""

    def __init__(self, runner, count: int, config: ExecutorConfig, blocks: BlockConfig):
        count = micro_batches(count, runner.spec.slots, blocks, runner.spec.max_seq_len)
        slots, share = runner.spec.slots, blocks.num_blocks // count
        if config.max_running is not None:
            config = dataclasses.replace(config, max_running=max(1, ceil_div(config.max_running, count)))
        bounds = [v * slots // count for v in range(count + 1)]
        self.executors = [Executor(SlotRange(runner, lo, hi), None, config, dataclasses.replace(blocks, num_blocks=share))
                          for lo, hi in zip(bounds[:-1], bounds[1:])]
        self._handles: list[list[RequestHandle]] = [[] for _ in self.executors]  # each executor's requests
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self.executors)

    def _roomiest(self, extra: list[int]) -> int:
        """The executor with the most free slots for one more request (its slots less its unfinished requests and
        `extra` about to be queued); the first on a tie."""
        room = [e.runner.cache.spec.slots - sum(h.finish_reason is None for h in handles) - n
                for e, handles, n in zip(self.executors, self._handles, extra)]
        return room.index(max(room))

    def _assigned(self, v: int, handles: list[RequestHandle]) -> list[RequestHandle]:
        self._handles[v] = [h for h in self._handles[v] if h.finish_reason is None] + handles
        return handles

    def submit_sequence(self, seq: Sequence, listener=None) -> RequestHandle:
        with self._lock:
            v = self._roomiest([0] * len(self.executors))
            return self._assigned(v, [self.executors[v].submit_sequence(seq, listener)])[0]

    def submit_sequences(self, seqs: list[Sequence]) -> list[RequestHandle]:
        """Spread `seqs` over the executors (most free slots first); each executor queues its share at once."""
        with self._lock:
            shares: list[list[int]] = [[] for _ in self.executors]
            for i in range(len(seqs)):
                shares[self._roomiest([len(s) for s in shares])].append(i)
            handles: dict[int, RequestHandle] = {}
            for v, (executor, share) in enumerate(zip(self.executors, shares)):
                if share:
                    queued = executor.submit_sequences([seqs[i] for i in share])
                    handles |= dict(zip(share, self._assigned(v, queued)))
            return [handles[i] for i in range(len(seqs))]

    def cancel(self, handle: RequestHandle) -> None:
        handle.cancel()

    def add_step_listener(self, listener) -> None:
        for e in self.executors:
            e.add_step_listener(listener)

    def add_step_observer(self, observer) -> None:
        for e in self.executors:
            e.add_step_observer(observer)

    def remove_step_observer(self, observer) -> None:
        for e in self.executors:
            e.remove_step_observer(observer)

    def step(self) -> None:
        for e in self.executors:
            e.step()

    @property
    def failure(self) -> str | None:
        return next((e.failure for e in self.executors if e.failure), None)

    @property
    def totals(self) -> dict:
        return _summed([e.totals for e in self.executors])

    def stats(self) -> dict:
        return _summed([e.stats() for e in self.executors]) | {"virtual_engines": len(self.executors)}

    def shutdown(self) -> None:
        for e in self.executors:
            e.shutdown()


def micro_batches(wanted: int, slots: int, blocks: BlockConfig, max_seq_len: int) -> int:
    """`wanted` micro-batches, fewer where the KV slots or block budget cannot give each its own share (a KV slot
    range, and blocks for one sequence of max_seq_len): at batch 1 there is nothing to overlap anyway."""
    count, need = min(wanted, slots), ceil_div(max_seq_len, blocks.block_size)
    while count > 1 and blocks.num_blocks // count < need:
        count -= 1
    return count


def _summed(dicts: list[dict]) -> dict:
    """Numbers summed key by key (rates too: the executors run at once); anything else the first one's."""
    out = dict(dicts[0])
    for d in dicts[1:]:
        for key, value in d.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = out[key] + value
    return out
