"""Rank 0 of a pipeline-parallel engine: the Runner the executors call, over stages that run in processes of
their own (ranks 1..P: runtime/parallel/stage.py) and pass hidden states to each other over torch.distributed
(gloo). It starts them on this machine, or, under torchrun, finds them started on any machine
(runtime/parallel/launch.py).

Rank 0 holds no layers: it schedules, samples and sends each call to every stage as a StageStep. Several calls
may be in flight at once, one per executor thread (runtime/parallel/virtual_engines.py keeps one micro-batch
per stage): `run` posts its step without waiting for the stages, then waits its turn for the last stage's
logits, which come back in the order the steps went out. A stage that dies, fails or hangs stops the engine
as a tensor-parallel rank does: calls in flight and later ones raise PipelineParallelError naming the stage."""
from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from runtime.config import LoadConfig
from runtime.lora.pool import AdapterPool
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError, Manifest
from runtime.model.device import providers
from runtime.model.runner import Runner
from runtime.parallel.launch import Beats, Launch, start_stages
from runtime.parallel.processes import describe, end, spawn, wait_loaded
from runtime.parallel.stage import placement
from runtime.parallel.stage_lora import AdapterSender
from runtime.parallel.rank import TIMEOUT_S
from runtime.parallel.step import RELEASED
from runtime.parallel.stage_step import LOGITS, NEXT_TOKEN, TAG, StageStep, post


class PipelineParallelError(EngineError, RuntimeError):
    """A pipeline stage died, hung or failed; the engine is stopped."""


class SlotRecorder:
    """Rank 0's stand-in for a KV cache (the stages hold the buffers): the spec the scheduler plans with, and
    the prefix copies and rows handed back it makes, queued for the stages (`take`)."""

    def __init__(self, spec: KVCacheSpec, device: str):
        self.spec, self.device = spec, device
        self._pending: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()

    def copy_prefix(self, src: int, dst: int, tokens: int) -> None:
        with self._lock:
            self._pending.append((src, dst, tokens))

    def release_row(self, slot: int, start: int = 0) -> None:
        with self._lock:
            self._pending.append((RELEASED, slot, start))

    def take(self) -> tuple[tuple[int, int, int], ...]:
        with self._lock:
            pending, self._pending = tuple(self._pending), []
        return pending


class PipelineRunner(Runner):
    """Rank 0 of a pipeline-parallel engine with the Runner interface (run/prefill/extend/decode, cache); starts
    the stages on load and stops them on `close()`. `config.threads` is per stage (default: the CPU cores
    divided among the stages)."""

    def __init__(self, engine_dir: Path, manifest: Manifest, spec: KVCacheSpec, config: LoadConfig = LoadConfig()):
        section = manifest.pipeline_parallel
        self.stages, self.tp, self.world = section.size, section.tensor_parallel, section.world
        self.last_rank = section.world - section.tensor_parallel  # the last stage's tp rank 0: it returns the logits
        self.micro_batches = config.micro_batches or self.stages  # LoadConfig.micro_batches, default one per stage
        device = config.device or manifest.target.device
        if config.graph_decode:
            raise EngineError("graph_decode (decode on fixed buffers, CUDA graphs on a GPU) is not supported by a "
                              "pipeline-parallel engine's stages, which decode eagerly; load it without graph_decode")
        if device == "cuda":  # what each stage process needs, said here rather than as a stage's exit code
            providers(manifest, device)
            placement(device, [], torch.cuda.is_available())
        self.config = dataclasses.replace(config, device=device,
                                          threads=config.threads or max(1, (os.cpu_count() or 1) // (self.world - 1)))
        super().__init__(engine_dir, manifest, spec, SlotRecorder(spec, device), False)
        self.has_next_token = True  # greedy rows: the last stage returns the ids (its ArgMax) instead of the logits
        self.vocab = section.stages[-1].ranks[0].segments[-1].outputs["logits"]["shape"][-1]
        if manifest.lora is not None:  # one pool for every micro-batch; each stage gets its layers' A/B
            self.lora = AdapterPool(manifest.lora, spec.slots)
        self.adapters = AdapterSender(self.lora, section) if self.lora is not None else None
        self.workers: list[subprocess.Popen] = []
        self.failure: str | None = None
        self._send = threading.Lock()  # steps go out whole and in order
        self._turn = threading.Condition()  # results come back in that order
        self._sent = self._received = 0
        self.calls_in_flight_max = 0  # the most calls posted and not yet returned (how much the stages overlap)
        self.beats: Beats | None = None  # the stage ranks' heartbeats, where torchrun started them
        if (launch := Launch.from_env()) is not None:  # ranks 1..P started by torchrun (runtime/parallel/launch.py)
            store, self.beats = start_stages(launch, section, engine_dir, spec, dataclasses.replace(
                self.config, threads=config.threads))
        else:
            store = dist.TCPStore("127.0.0.1", 0, self.world, True, datetime.timedelta(seconds=TIMEOUT_S),
                                  wait_for_workers=False)
            self._spawn(engine_dir, spec, store)
        self.group = dist.ProcessGroupGloo(store, 0, self.world, datetime.timedelta(seconds=TIMEOUT_S))
        self._state = {"broken": False}
        # stages of torchrun's get the whole timeout to take the STOP (nothing here can end them), and this rank
        # waits until they have: closing the connections first would lose a STOP not yet read
        settle = self.beats.wait_stopped_cleanly if self.beats is not None else None
        grace = TIMEOUT_S if self.beats is not None else 5.0
        self._finalizer = weakref.finalize(self, _stop, self.group, self.workers, self._state, grace, settle)

    @property
    def new_call_shapes(self) -> int:
        return 0  # bound on the stages

    def _spawn(self, engine_dir: Path, spec: KVCacheSpec, store: dist.TCPStore) -> None:
        """Start each stage's processes, stage s's tp rank t as rank 1 + s * tp + t (`python -m
        runtime.parallel.stage`), and wait until each has loaded (runtime/parallel/processes.py)."""
        indices = range(self.world - 1)
        self.workers.extend(spawn("runtime.parallel.stage", engine_dir, indices, self.world, store.port, spec,
                                  self.config))
        wait_loaded(store, self.workers, [f"ready/{i + 1}" for i in indices],
                    lambda i, code: PipelineParallelError(f"{describe(self.tp, i + 1)} exited with code {code} "
                                                          f"while loading (its error is printed above)"))

    def run(self, start: int, input_ids: np.ndarray, seqlens_k: np.ndarray, total_len: int,
            logits_index: np.ndarray, head: str = "logits") -> np.ndarray:
        self._check_head(head)
        if self.failure:
            raise PipelineParallelError(self.failure)
        index = np.asarray(logits_index)
        with self._send:
            rows, lora = len(input_ids), self.adapters
            step = StageStep(start, np.asarray(input_ids), np.asarray(seqlens_k), total_len, index, self.cache.take(),
                             NEXT_TOKEN if head == "next_token" else LOGITS,
                             lora.rows(start, rows) if lora else np.zeros(0, np.int64), lora.changed() if lora else ())
            try:
                posted = [p for rank in range(1, self.world) for p in post(step, self.group, rank)]
                if step.new_slots:  # after the step: a stage reads them once it has it
                    posted += lora.post(step.new_slots, self.group, TAG)
            except RuntimeError as err:
                raise self._fail(err) from err
            ticket, self._sent = self._sent, self._sent + 1
        shape, dtype = ((len(index),), torch.int64) if head == "next_token" else ((len(index), self.vocab), torch.float32)
        result = torch.empty(shape, dtype=dtype)  # the last stage's logits, or the ids its ArgMax chose
        with self._turn:
            self._turn.wait_for(lambda: self._received == ticket or self.failure is not None)
            self.calls_in_flight_max = max(self.calls_in_flight_max, self._sent - self._received)
        try:
            if self.failure:
                raise PipelineParallelError(self.failure)
            try:
                self.group.recv([result], self.last_rank, TAG).wait(datetime.timedelta(seconds=TIMEOUT_S))
                for work, _ in posted:
                    work.wait(datetime.timedelta(seconds=TIMEOUT_S))
            except RuntimeError as err:
                raise self._fail(err) from err
        finally:
            with self._turn:
                self._received += 1
                self._turn.notify_all()
        return result.numpy()

    def _fail(self, err: Exception) -> PipelineParallelError:
        """Stop the engine after a failed send or receive; the error names the stage that exited, if one did."""
        with self._turn:
            if self.failure is None:
                self.failure = self._explain(err)
                self._state["broken"] = True
            self._turn.notify_all()
        self.close()
        return PipelineParallelError(self.failure)

    def _explain(self, err: Exception) -> str:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and all(p.poll() is None for p in self.workers):
            time.sleep(0.02)
        gone = [(i, p.returncode) for i, p in enumerate(self.workers) if p.poll() is not None]
        if gone:  # the one that died, not those that left after it (exit code 1: a neighbour's send or receive failed)
            index, code = min(gone, key=lambda g: g[1] == 1)
            return (f"{describe(self.tp, index + 1)} exited (exit code {code}) during a step; the engine is stopped, "
                    f"load it again ({err})")
        if self.beats is not None and (stopped := self.beats.wait_stopped()):
            return (f"{', '.join(describe(self.tp, r) for r in stopped)} exited or became unreachable during a "
                    f"step (heartbeat stopped; the exit code is in its torchrun's output); the engine is stopped, "
                    f"load it again ({err})")
        return (f"a pipeline stage's send or receive failed or timed out after {TIMEOUT_S:g} s "
                f"(ENGINE_TP_TIMEOUT_S); the engine is stopped, load it again ({err})")

    def close(self) -> None:
        """Stop the stages (a STOP step, then terminate any that linger); idempotent."""
        self._finalizer()


def _stop(group, workers: list[subprocess.Popen], state: dict, grace: float, settle=None) -> None:
    if group is not None and not state["broken"] and all(p.poll() is None for p in workers):
        try:
            for rank in range(1, group.size()):
                for work, _ in post(StageStep(stop=True), group, rank):
                    work.wait(datetime.timedelta(seconds=grace))
            if settle is not None:
                settle(grace)
        except RuntimeError:
            pass  # a stage is already gone: terminate the rest below
    end(workers, state["broken"])
