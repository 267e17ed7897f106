"""Tensor-parallel engines: one process per rank, each running its segments with ONNX Runtime and summing
the cut values over the ranks with torch.distributed (gloo on CPU, NCCL on GPU).

Rank 0 is the process that loaded the engine (`LLM(DIR)`): it owns the tokenizer, scheduler and sampler,
and its `TensorParallelRunner` has ModelRunner's interface, so the in-flight batching executor drives it
unchanged. Each call, rank 0 broadcasts the step (header + token ids + KV prefix copies) to the workers
it spawned, and every rank runs the same segments on its shard. Ranks other than 0 stop at the last
all-reduce: what follows (final norm, lm_head) is the same everywhere and only rank 0 needs the logits.

Buffers cross between ONNX Runtime and torch without copies: every segment's inputs and outputs are
bound (IOBinding) to numpy buffers made once per call shape, and the all-reduce works in place on
`torch.from_numpy` views of them. Under `torchrun`, every process calls LLM(DIR); ranks other than 0
serve the workers' loop inside it and exit when rank 0 closes."""
from __future__ import annotations

import datetime
import os
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.distributed as dist

from runtime.kv_cache import KVCache, common_prefix
from runtime.kv_spec import KVCacheSpec
from runtime.manifest import EngineError, load_manifest
from runtime.model_runner import MAX_CALLS, ModelRunner, rope_tables, session_options

RUN, STOP = 1, 2
HEADER = 8  # op, start, rows, seq, n, total_len, number of KV copies, unused
TIMEOUT_S = float(os.environ.get("ENGINE_TP_TIMEOUT_S", "60"))  # a collective that waits longer fails
IDLE = datetime.timedelta(days=365)  # workers wait this long for rank 0's next step
TRACE_ENV = "ENGINE_TP_TRACE"  # a folder: every rank records its steps' timestamps and writes them there (benchmarks)


class TensorParallelError(EngineError, RuntimeError):
    """A rank died, hung or failed; the tensor-parallel engine is stopped."""


def backend(device: str) -> str:
    """The collective backend: ENGINE_TP_BACKEND (gloo | nccl), by default NCCL for a cuda engine when torch
    sees CUDA, else gloo (gloo also runs a cuda engine's ranks on one GPU, which NCCL refuses)."""
    choice = os.environ.get("ENGINE_TP_BACKEND") or ("nccl" if device == "cuda" and torch.cuda.is_available()
                                                     else "gloo")
    if choice not in ("gloo", "nccl"):
        raise EngineError(f"ENGINE_TP_BACKEND={choice!r}: the tensor-parallel backends are 'gloo' and 'nccl'")
    if choice == "nccl" and not (device == "cuda" and torch.cuda.is_available()):
        raise EngineError(f"ENGINE_TP_BACKEND=nccl needs a cuda engine and torch with CUDA (engine device "
                          f"{device!r}, CUDA available: {torch.cuda.is_available()}); use gloo")
    return choice


def _group(rank: int, size: int, store: dist.Store, device: str):
    """A process group of its own (not torch's global default, so one process can load several engines)."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if backend(device) == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return dist.ProcessGroupNCCL(store, rank, size, timeout=timeout)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class RankEngine:
    """One rank's segments, KV-cache shard and bound call buffers."""

    def __init__(self, engine_dir: Path, manifest: dict, spec: KVCacheSpec, rank: int, group, device: str,
                 threads: int | None, providers: list[str] | None, cache: KVCache | None = None):
        section = manifest["tensor_parallel"]
        self.segments = section["ranks"][rank]["segments"]
        self.collectives = section["collectives"]
        self.group, self.device, self.rank, self.backend = group, device, rank, backend(device)
        options = session_options(threads)
        self.sessions = [ort.InferenceSession(str(engine_dir / s["file"]), options,
                                              providers=providers or ["CPUExecutionProvider"])
                         for s in self.segments]
        self.cache = cache or KVCache(spec)
        self.cos, self.sin = rope_tables(manifest["rope"], spec.max_seq_len, spec.dtype)
        self._calls: dict[tuple[int, int, int, int], _SegmentCall] = {}
        self.new_call_shapes = 0
        self.reduce_seconds = 0.0  # time spent in all-reduces (for benchmarks)
        # with ENGINE_TP_TRACE: per step [tokens, start, (all-reduce enter, exit) per collective..., end]
        self.trace: list[list[float]] | None = [] if os.environ.get(TRACE_ENV) else None

    def step(self, start: int, ids: np.ndarray, seqlens: np.ndarray, total: int, index: np.ndarray):
        """Run every segment of this rank with the all-reduces between them; rank 0 returns logits."""
        call = self._call(start, ids.shape[0], ids.shape[1], len(index))
        call.set(ids, seqlens, total, index)
        times = [ids.size, time.perf_counter()]
        for k, (session, binding) in enumerate(zip(self.sessions, call.bindings)):
            session.run_with_iobinding(binding)
            if k < len(self.collectives):
                times.append(time.perf_counter())
                self._all_reduce(call.reduced[k])
                times.append(time.perf_counter())
                self.reduce_seconds += times[-1] - times[-2]
        if self.trace is not None:
            self.trace.append(times + [time.perf_counter()])
        return call.buffers.get("logits")

    def save_trace(self) -> None:
        """Write this rank's step timestamps to ENGINE_TP_TRACE/rank{r}.json (when tracing is on)."""
        if self.trace is not None:
            import json

            (Path(os.environ[TRACE_ENV]) / f"rank{self.rank}.json").write_text(json.dumps(self.trace))

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if self.backend == "nccl":  # NCCL sums device tensors
            on_device = tensor.cuda()
            self.group.allreduce([on_device]).wait()
            tensor.copy_(on_device.cpu())
        else:
            self.group.allreduce([tensor]).wait()

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        for k, v in zip(self.cache.keys, self.cache.values):
            k[slot, :, :length] = k[source, :, :length]
            v[slot, :, :length] = v[source, :, :length]

    def _call(self, start: int, rows: int, seq: int, n: int) -> _SegmentCall:
        key = (start, rows, seq, n)
        call = self._calls.pop(key, None)
        if call is None:
            call = _SegmentCall(self, start, {"batch": rows, "seq": seq, "num_logits": n})
            self.new_call_shapes += 1
        self._calls[key] = call
        if len(self._calls) > MAX_CALLS:
            del self._calls[next(iter(self._calls))]
        return call


class _SegmentCall:
    """Every segment's IOBinding for one call shape: boundary values in numpy buffers shared by the
    segment that writes them and those that read them; a collective's output is its input's buffer."""

    def __init__(self, engine: RankEngine, start: int, dims: dict[str, int]):
        self.buffers: dict[str, np.ndarray] = {}
        views = engine.cache.views(start, start + dims["batch"])
        fixed = {"cos_cache": engine.cos, "sin_cache": engine.sin}
        self._values: list[ort.OrtValue] = []  # kept alive as long as the bindings
        self.bindings, self.reduced = [], []
        for k, (session, seg) in enumerate(zip(engine.sessions, engine.segments)):
            binding = session.io_binding()
            for name, info in seg["inputs"].items():
                binding.bind_ortvalue_input(name, self._value(name, info, dims, views, fixed, "past_"))
            for name, info in seg["outputs"].items():
                binding.bind_ortvalue_output(name, self._value(name, info, dims, views, fixed, "present_"))
            self.bindings.append(binding)
            if k < len(engine.collectives):
                cut = engine.collectives[k]
                self.buffers[cut["output"]] = self.buffers[cut["input"]]
                self.reduced.append(torch.from_numpy(self.buffers[cut["input"]]))

    def _value(self, name: str, info: dict, dims: dict, views, fixed: dict, kv_prefix: str) -> ort.OrtValue:
        if name.startswith(kv_prefix):
            kind, layer = name[len(kv_prefix):].rsplit("_", 1)
            value = views[int(layer)][0 if kind == "key" else 1]
        else:
            if name not in self.buffers:
                self.buffers[name] = fixed.get(name)
                if self.buffers[name] is None:
                    shape = [dims[d] if isinstance(d, str) else d for d in info["shape"]]
                    self.buffers[name] = np.zeros(shape, info["dtype"])
            value = ort.OrtValue.ortvalue_from_numpy(self.buffers[name])
        self._values.append(value)
        return value

    def set(self, ids: np.ndarray, seqlens: np.ndarray, total: int, index: np.ndarray) -> None:
        for name, array in (("input_ids", ids), ("seqlens_k", seqlens), ("total_sequence_length", total),
                            ("logits_index", index)):
            if name in self.buffers:
                self.buffers[name][...] = array


class _CopyRecordingCache(KVCache):
    """Rank 0's KV bookkeeping: a prefix copied between slots in `claim` is queued for the workers too."""

    def __init__(self, spec: KVCacheSpec):
        super().__init__(spec)
        self.pending: list[tuple[int, int, int]] = []  # (source slot, slot, length)

    def claim(self, prompt: list[int], min_reuse: int) -> tuple[int, int]:
        before = [list(c) for c in self.contents]
        used = set(self.used)
        slot, reuse = super().claim(prompt, min_reuse)
        if reuse and common_prefix(before[slot], prompt[:reuse]) < reuse:
            source = next(s for s in used if common_prefix(before[s], prompt[:reuse]) >= reuse)
            self.pending.append((source, slot, reuse))
        return slot, reuse


class TensorParallelRunner(ModelRunner):
    """Rank 0 of a tensor-parallel engine, with ModelRunner's interface (run/prefill/extend/decode, cache).

    Starts ranks 1..N-1 as worker processes (or joins a `torchrun` launch) and stops them on `close()`.
    `threads`: ONNX Runtime threads per rank (default: the CPU cores divided among the ranks)."""

    def __init__(self, engine_dir: Path, manifest: dict, spec: KVCacheSpec, threads: int | None = None,
                 providers: list[str] | None = None):
        self.engine_dir, self.spec, self.manifest, self.dtype = engine_dir, spec, manifest, spec.dtype
        self.size = manifest["tensor_parallel"]["size"]
        self.device = manifest["target"]["device"]
        backend(self.device)  # a bad ENGINE_TP_BACKEND is refused before any worker starts
        self.vocab_size = manifest["model"]["hyperparameters"]["vocab_size"]
        # rank 0 returns full logits: no sampling-head outputs and no CUDA-graph buckets (eager decode)
        self.graph_buckets: list[int] = []
        self.has_next_token, self.top_k = False, 0
        threads = threads or max(1, (os.cpu_count() or 1) // self.size)
        self.workers: list = []
        self.copies_sent = 0  # KV prefix copies replayed on the workers
        self.failure: str | None = None
        launched = _torchrun_rank()
        if launched is None:
            store = dist.TCPStore("127.0.0.1", 0, self.size, True, datetime.timedelta(seconds=TIMEOUT_S),
                                  wait_for_workers=False)
            self._spawn(store, threads)
            group = _group(0, self.size, store, self.device)
        else:
            group = _torchrun_group(self.size, self.device)
            if launched != 0:
                _serve(RankEngine(engine_dir, manifest, spec, launched, group, self.device, threads, providers))
                sys.exit(0)  # a torchrun worker's whole job was serving rank 0
        self.cache = _CopyRecordingCache(spec)
        self.engine = RankEngine(engine_dir, manifest, spec, 0, group, self.device, threads, providers, self.cache)
        self._state = {"broken": False}
        self._finalizer = weakref.finalize(self, _stop, group, self.workers, self._state)

    @property
    def new_call_shapes(self) -> int:
        return self.engine.new_call_shapes

    def _spawn(self, store: dist.TCPStore, threads: int) -> None:
        """Start ranks 1.. as `python -m runtime.tensor_parallel` processes (not multiprocessing: a user's
        script without a __main__ guard is not re-imported) and wait until each has loaded its segments."""
        import json
        import subprocess

        for rank in range(1, self.size):
            command = [sys.executable, "-m", "runtime.tensor_parallel", str(self.engine_dir), str(rank),
                       str(self.size), str(store.port), json.dumps(self.spec.to_dict()), str(threads)]
            self.workers.append(subprocess.Popen(command))
        waiting = {rank: f"ready/{rank}" for rank in range(1, self.size)}
        while waiting:
            for rank, key in list(waiting.items()):
                if store.check([key]):
                    del waiting[rank]
                elif self.workers[rank - 1].poll() is not None:
                    _stop(None, self.workers, {"broken": True})
                    raise TensorParallelError(f"tensor-parallel worker rank {rank} exited with code "
                                              f"{self.workers[rank - 1].returncode} while loading its segments "
                                              f"(its error is printed above)")
            time.sleep(0.02)

    def run(self, start: int, input_ids: np.ndarray, seqlens_k: np.ndarray, total_len: int,
            logits_index: np.ndarray, head: str = "logits") -> np.ndarray:
        self._check_head(head)
        if self.failure:
            raise TensorParallelError(self.failure)
        rows, seq = input_ids.shape
        copies, self.cache.pending = self.cache.pending, []
        self.copies_sent += len(copies)
        header = torch.tensor([RUN, start, rows, seq, 0, total_len, len(copies), 0], dtype=torch.int64)
        payload = np.concatenate([np.asarray(input_ids, np.int64).ravel(), np.asarray(seqlens_k, np.int64),
                                  np.asarray(copies, np.int64).reshape(-1)])
        try:
            self.engine.group.broadcast(header, 0).wait()
            self.engine.group.broadcast(torch.from_numpy(payload), 0).wait()
            logits = self.engine.step(start, np.asarray(input_ids), np.asarray(seqlens_k), total_len,
                                      np.asarray(logits_index))
        except RuntimeError as err:
            self.failure = self._explain(err)
            self._state["broken"] = True
            self.close()
            raise TensorParallelError(self.failure) from err
        return logits.copy()

    def _explain(self, err: Exception) -> str:
        for rank, process in enumerate(self.workers, start=1):
            if _wait(process, 1.0) is not None:
                return (f"tensor-parallel worker rank {rank} exited (exit code {process.returncode}) during a "
                        f"step; the engine is stopped, load it again ({err})")
        return (f"tensor-parallel collective failed or timed out after {TIMEOUT_S:g} s (ENGINE_TP_TIMEOUT_S); "
                f"the engine is stopped, load it again ({err})")

    def close(self) -> None:
        """Stop the workers (a STOP step, then terminate any that linger); idempotent."""
        self._finalizer()


def _wait(process, seconds: float) -> int | None:
    import subprocess

    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _stop(group, workers: list, state: dict) -> None:
    if group is not None and not state["broken"] and all(p.poll() is None for p in workers):
        header = torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64)
        try:
            group.broadcast(header, 0).wait()
        except RuntimeError:
            pass  # a rank is already gone: terminate the rest below
    grace = 0.5 if state["broken"] else 5.0  # a broken engine's workers get no time to finish a step
    for process in workers:
        if _wait(process, grace) is None:
            process.terminate()
            if _wait(process, grace) is None:
                process.kill()
                process.wait()


def _worker(engine_dir: str, rank: int, size: int, port: int, spec: dict, threads: int) -> None:
    """A spawned rank: load its segments, tell rank 0 it is ready, then serve steps until STOP."""
    from runtime.engine import providers

    try:
        engine_dir = Path(engine_dir)
        manifest = load_manifest(engine_dir, check_files=False)
        device = manifest["target"]["device"]
        store = dist.TCPStore("127.0.0.1", port, size, False, datetime.timedelta(seconds=TIMEOUT_S))
        engine = RankEngine(engine_dir, manifest, KVCacheSpec.from_dict(spec), rank, None, device, threads,
                            providers(manifest))
        store.set(f"ready/{rank}", "1")
        engine.group = _group(rank, size, store, device)
        _serve(engine)
    except RuntimeError as err:  # rank 0 died or a collective failed: leave, do not hang
        print(f"engine-tp rank {rank}: stopping: {err}", file=sys.stderr)
        sys.exit(1)


def _serve(engine: RankEngine) -> None:
    """A worker rank's loop: receive a step from rank 0, apply its KV copies, run the segments."""
    group = engine.group
    while True:
        header = torch.zeros(HEADER, dtype=torch.int64)
        group.broadcast(header, 0, IDLE).wait()
        op, start, rows, seq, _, total, copies, _ = header.tolist()
        if op == STOP:
            engine.save_trace()
            return
        payload = torch.zeros(rows * seq + rows + 3 * copies, dtype=torch.int64)
        group.broadcast(payload, 0).wait()
        values = payload.numpy()
        for source, slot, length in values[rows * seq + rows:].reshape(-1, 3):
            engine.copy_prefix(int(source), int(slot), int(length))
        engine.step(start, values[:rows * seq].reshape(rows, seq), values[rows * seq:rows * seq + rows],
                    total, np.zeros(0, np.int64))


def _torchrun_rank() -> int | None:
    """This process's rank when launched by torchrun (TORCHELASTIC_RUN_ID and RANK set), else None."""
    return int(os.environ["RANK"]) if "TORCHELASTIC_RUN_ID" in os.environ else None


def _torchrun_group(size: int, device: str):
    """torch's default group from torchrun's environment (env://): gloo on CPU, NCCL on GPU."""
    if int(os.environ["WORLD_SIZE"]) != size:
        raise EngineError(f"torchrun started {os.environ['WORLD_SIZE']} processes; this engine has "
                          f"tensor_parallel {size}: use --nproc-per-node {size}")
    chosen = backend(device)
    if chosen == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return dist.group.WORLD


if __name__ == "__main__":  # a rank started by TensorParallelRunner: ENGINE_DIR RANK SIZE PORT SPEC_JSON THREADS
    import json

    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]),
            int(sys.argv[6]))
