"""Tensor-parallel engines, rank 0: `TensorParallelRunner` starts the other ranks (runtime/parallel/worker.py)
or joins a `torchrun` launch, and runs the engine's steps with the Runner interface, so the in-flight
batching executor drives it unchanged.

Rank 0 is the process that loaded the engine (`LLM(DIR)`): it owns the tokenizer, scheduler and sampler.
Each call, rank 0 broadcasts the step (a Step: token ids, lengths, KV prefix copies) to the workers, and every
rank runs the same segments on its shard (runtime/parallel/rank.py). Ranks other than 0 stop at the last
all-reduce: what follows (final norm, lm_head) is the same everywhere and only rank 0 needs the logits.
Under `torchrun`, every process calls LLM(DIR); ranks other than 0 serve the workers' loop inside it
and exit when rank 0 closes."""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import weakref
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from runtime.config import LoadConfig
from runtime.model.kv_cache import KVCache
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError, Manifest
from runtime.model.runner import Runner
from runtime.parallel.processes import end, exited, spawn, wait_loaded
from runtime.parallel.rank import TIMEOUT_S, TRACE_ENV, RankEngine, backend, rank_device_id, rank_group
from runtime.parallel.step import RELEASED, Step, send
from runtime.parallel.worker import serve

__all__ = ["RankEngine", "TensorParallelError", "TensorParallelRunner", "TIMEOUT_S", "TRACE_ENV", "backend"]


class TensorParallelError(EngineError, RuntimeError):
    """A rank died, hung or failed; the tensor-parallel engine is stopped."""


class _CopyRecordingCache(KVCache):
    """Rank 0's KV cache: a prefix copied between slots, and a row whose pages are handed back (queued as a
    copy from slot -1, RELEASED), are queued for the workers too."""

    def __init__(self, spec: KVCacheSpec, *placement):  # placement: KVCache's device, backend, device_id
        super().__init__(spec, *placement)
        self.pending: list[tuple[int, int, int]] = []  # (source slot, slot, length)

    def copy_prefix(self, src: int, dst: int, tokens: int) -> None:
        super().copy_prefix(src, dst, tokens)
        self.pending.append((src, dst, tokens))

    def release_row(self, slot: int, start: int = 0) -> None:
        super().release_row(slot, start)
        self.pending.append((RELEASED, slot, start))


class TensorParallelRunner(Runner):
    """Rank 0 of a tensor-parallel engine, with the Runner interface (run/prefill/extend/decode, cache).

    Starts ranks 1..N-1 as worker processes (or joins a `torchrun` launch) and stops them on `close()`.
    `config` (runtime/config.py) holds for every rank: `threads` per rank (default: the CPU cores divided
    among the ranks), `device` (default: the engine's), `kv_backend`."""

    def __init__(self, engine_dir: Path, manifest: Manifest, spec: KVCacheSpec, config: LoadConfig = LoadConfig()):
        self.size = manifest.tensor_parallel.size
        self.device = config.device or manifest.target.device
        # every rank loads with this config: the device resolved, threads by default the cores divided among ranks
        self.config = dataclasses.replace(config, device=self.device,
                                          threads=config.threads or max(1, (os.cpu_count() or 1) // self.size))
        backend(self.device)  # a bad ENGINE_TP_BACKEND is refused before any worker starts
        self.workers: list = []
        self.copies_sent = 0  # KV prefix copies replayed on the workers
        self.failure: str | None = None
        launched = _torchrun_rank()
        if launched is None:
            store = dist.TCPStore("127.0.0.1", 0, self.size, True, datetime.timedelta(seconds=TIMEOUT_S),
                                  wait_for_workers=False)
            self._spawn(engine_dir, spec, store)
            group = rank_group(0, self.size, store, self.device, TIMEOUT_S)
        else:
            group = _torchrun_group(self.size, self.device)
            if launched != 0:
                serve(RankEngine(engine_dir, manifest, spec, launched, group, self.config, local_rank=_local_rank()))
                sys.exit(0)  # a torchrun worker's whole job was serving rank 0
        local = _local_rank() if launched is not None else 0
        device_id = rank_device_id(local, self.device)
        # rank 0 reads the all-reduced full logits: no graph sampling head and no CUDA-graph buckets (Runner's
        # defaults); greedy rows get the ArgMax of those logits from `run` (so greedy decode steps can run ahead)
        super().__init__(engine_dir, manifest, spec,
                         _CopyRecordingCache(spec, self.device, self.config.kv_backend, device_id),
                         self.config.buckets_on(self.device))
        self.has_next_token = True
        self.engine = RankEngine(engine_dir, manifest, spec, 0, group, self.config, self.cache, local_rank=local)
        self._state = {"broken": False}
        self._finalizer = weakref.finalize(self, _stop, self.engine, self.workers, self._state)

    @property
    def new_call_shapes(self) -> int:
        return self.engine.new_call_shapes

    def _spawn(self, engine_dir: Path, spec: KVCacheSpec, store: dist.TCPStore) -> None:
        """Start ranks 1.. as `python -m runtime.parallel.worker` processes and wait until each has loaded its
        segments (runtime/parallel/processes.py)."""
        ranks = range(1, self.size)
        self.workers.extend(spawn("runtime.parallel.worker", engine_dir, ranks, self.size, store.port, spec,
                                  self.config))
        wait_loaded(store, self.workers, [f"ready/{rank}" for rank in ranks], lambda i, code: TensorParallelError(
            f"tensor-parallel worker rank {i + 1} exited with code {code} while loading its segments (its error is "
            f"printed above)"))

    def run(self, start: int, input_ids: np.ndarray, seqlens_k: np.ndarray, total_len: int,
            logits_index: np.ndarray, head: str = "logits") -> np.ndarray:
        self._check_head(head)
        if self.failure:
            raise TensorParallelError(self.failure)
        copies, self.cache.pending = self.cache.pending, []
        self.copies_sent += sum(1 for source, _, _ in copies if source != RELEASED)
        step = Step(start, np.asarray(input_ids), np.asarray(seqlens_k), total_len, tuple(copies))
        try:
            send(step, self.engine.broadcast)  # runtime/parallel/step.py
            logits = self.engine.step(start, step.ids, step.seqlens, total_len, np.asarray(logits_index))
        except RuntimeError as err:
            self.failure = self._explain(err)
            self._state["broken"] = True
            self.close()
            raise TensorParallelError(self.failure) from err
        return logits.argmax(-1) if head == "next_token" else logits.copy()

    def _explain(self, err: Exception) -> str:
        for rank, process in enumerate(self.workers, start=1):
            if exited(process, 1.0) is not None:
                return (f"tensor-parallel worker rank {rank} exited (exit code {process.returncode}) during a "
                        f"step; the engine is stopped, load it again ({err})")
        return (f"tensor-parallel collective failed or timed out after {TIMEOUT_S:g} s (ENGINE_TP_TIMEOUT_S); "
                f"the engine is stopped, load it again ({err})")

    def close(self) -> None:
        """Stop the workers (a STOP step, then terminate any that linger); idempotent."""
        self._finalizer()


def _stop(engine: RankEngine | None, workers: list, state: dict) -> None:
    if engine is not None and not state["broken"] and all(p.poll() is None for p in workers):
        try:
            send(Step(stop=True), engine.broadcast)
        except RuntimeError:
            pass  # a rank is already gone: terminate the rest below
    end(workers, state["broken"])


def _torchrun_rank() -> int | None:
    """This process's rank when launched by torchrun (TORCHELASTIC_RUN_ID and RANK set), else None."""
    return int(os.environ["RANK"]) if "TORCHELASTIC_RUN_ID" in os.environ else None


def _local_rank() -> int:
    """This process's rank on its node under torchrun (LOCAL_RANK): which of the node's GPUs it uses."""
    return int(os.environ.get("LOCAL_RANK", 0))


def _torchrun_group(size: int, device: str):
    """torch's default group from torchrun's environment (env://): gloo on CPU, NCCL on GPU."""
    if int(os.environ["WORLD_SIZE"]) != size:
        raise EngineError(f"torchrun started {os.environ['WORLD_SIZE']} processes; this engine has "
                          f"tensor_parallel {size}: use --nproc-per-node {size}")
    chosen = backend(device)
    if chosen == "nccl":
        torch.cuda.set_device(rank_device_id(_local_rank(), device, chosen))
    if not dist.is_initialized():
        dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return dist.group.WORLD
