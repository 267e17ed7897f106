"""One rank's share of a tensor-parallel engine: its segments, KV-cache shard, bound call buffers and the
all-reduces between segments (torch.distributed: gloo on CPU, NCCL on GPU).

Buffers cross between ONNX Runtime and torch without copies: the values between segments (hidden states
around each all-reduce, the rotary tables, the logits) are torch tensors on the rank's device, made once per
call shape and bound to every segment's IOBinding by pointer; the all-reduce sums them in place (NCCL on the
GPU with no host round trip; gloo on CPU, the same code). The KV shard is the rank's KVCache on its device.
The step's small inputs (token ids, lengths, logits index) are device tensors too, bound once by pointer and
copied into each step: ONNX Runtime copies a host input to the device once, when it is bound, so a host array
written later would never reach the GPU. Only `total_sequence_length` stays a host array (HOST_READ)."""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.distributed as dist

from runtime.config import LoadConfig
from runtime.model.device import HOST_READ, open_session, providers
from runtime.model.kv_cache import ONNX_TYPES, KVCache
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError, Manifest
from runtime.manifest.types import SegmentFile
from runtime.model.call_cache import CallCache
from runtime.model.ort_session import session_options
from runtime.model.weight_kernels import configure
from runtime.model.rotary import rope_tables
from runtime.parallel.step import RELEASED

TIMEOUT_S = float(os.environ.get("ENGINE_TP_TIMEOUT_S", "60"))  # a collective that waits longer fails
TRACE_ENV = "ENGINE_TP_TRACE"  # a folder: every rank records its steps' timestamps and writes them there (benchmarks)
TORCH_TYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "int32": torch.int32, "int64": torch.int64}
ELEMENT_TYPES = {**ONNX_TYPES, "int32": 6, "int64": 7}  # onnx.TensorProto element types


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


def rank_device_id(rank: int, device: str, collective: str | None = None, device_count: int | None = None) -> int:
    """The GPU a rank computes on: with NCCL each rank its own (`rank % device_count`, by default the GPUs
    torch sees; under torchrun pass the local rank); with gloo, or on CPU, GPU 0 (gloo is how several
    ranks share one GPU). `collective` defaults to `backend(device)`."""
    if device != "cuda" or (collective or backend(device)) != "nccl":
        return 0
    count = torch.cuda.device_count() if device_count is None else device_count
    if count < 1:
        raise EngineError(f"rank {rank}: NCCL needs a GPU, and torch sees {count}")
    return rank % count


def rank_providers(providers: list | None, device_id: int) -> list:
    """A rank's ONNX Runtime providers: CUDA's with the rank's `device_id` (other providers as given)."""
    chosen = []
    for provider in providers or ["CPUExecutionProvider"]:
        name, options = provider if isinstance(provider, tuple) else (provider, {})
        chosen.append((name, {**options, "device_id": device_id}) if name == "CUDAExecutionProvider" else provider)
    return chosen


def rank_group(rank: int, size: int, store: dist.Store, device: str, timeout_s: float = TIMEOUT_S):
    """A process group of its own (not torch's global default, so one process can load several engines);
    a collective that waits longer than `timeout_s` fails."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend(device) == "nccl":
        torch.cuda.set_device(rank_device_id(rank, device, "nccl"))
        return dist.ProcessGroupNCCL(store, rank, size, timeout=timeout)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class RankEngine:
    """One rank's segments, KV-cache shard and bound call buffers, on the rank's device: its GPU
    (`rank_device_id`) on CUDA. `config` (runtime/config.py, its device resolved) as every rank loads:
    `threads`, `kv_backend` (the KV cache's: "ortvalue" on CUDA; numpy by default on CPU, where "ortvalue"
    runs the CUDA code path). `cache`: rank 0's, made by its runner; `local_rank` picks the GPU under torchrun."""

    def __init__(self, engine_dir: Path, manifest: Manifest, spec: KVCacheSpec, rank: int, group, config: LoadConfig,
                 cache: KVCache | None = None, local_rank: int | None = None):
        section = manifest.tensor_parallel
        self.segments = section.ranks[rank].segments
        self.collectives = section.collectives
        device = config.device
        self.group, self.device, self.rank, self.backend = group, device, rank, backend(device)
        self.device_id = rank_device_id(rank if local_rank is None else local_rank, device, self.backend)
        options = session_options(config.threads)
        configure(options, config.weight_kernels, manifest.target.weight_kernels, device)
        chosen = rank_providers(providers(manifest, device), self.device_id)
        self.sessions = [open_session(engine_dir / s.file, options, chosen)
                         for s in self.segments]
        self.cache = cache or KVCache(spec, device, config.kv_backend, self.device_id)
        if device == "cuda" and not torch.cuda.is_available():  # host tensors would reach the GPU once, at binding
            raise EngineError(f"tensor parallelism on cuda keeps its step and boundary tensors on the GPU through "
                              f"torch, and this torch {torch.__version__} has no CUDA: install a CUDA build of torch "
                              f"or load with device='cpu'")
        # boundary and step tensors live where the sessions run: the rank's GPU, or host memory on CPU
        self.torch_device = torch.device("cuda", self.device_id) if device == "cuda" else torch.device("cpu")
        self.tables = {name: _torch_table(table, spec.dtype).to(self.torch_device) for name, table in
                       zip(("cos_cache", "sin_cache"), rope_tables(manifest.rope, spec.max_seq_len, spec.dtype))}
        self._calls = CallCache()  # (start, rows, seq, n) -> _SegmentCall
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
        logits = call.tensors.get("logits")
        return None if logits is None else logits.cpu().numpy()

    def save_trace(self) -> None:
        """Write this rank's step timestamps to ENGINE_TP_TRACE/rank{r}.json (when tracing is on)."""
        if self.trace is not None:
            import json

            (Path(os.environ[TRACE_ENV]) / f"rank{self.rank}.json").write_text(json.dumps(self.trace))

    def broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        """Rank 0's `tensor` into every rank's, in place (the step's header and token ids). NCCL moves only
        GPU tensors: under it the host tensor is staged through the rank's GPU and copied back."""
        staged = tensor.to(self.torch_device, copy=True) if self.backend == "nccl" else tensor
        self.group.broadcast(staged, 0, timeout).wait()
        if staged is not tensor:
            tensor.copy_(staged)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks in place (on the device when it is there)."""
        self.group.allreduce([tensor]).wait()
        if tensor.is_cuda:  # ONNX Runtime reads it on a stream of its own: the sum must be complete
            torch.cuda.synchronize(tensor.device)

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """A prefix copy rank 0 made in its cache, replayed in this rank's shard (on the device); from source
        RELEASED (runtime/parallel/step.py): the row's pages from token `length` on handed back, as rank 0 did."""
        if source == RELEASED:
            self.cache.release_row(slot, length)
            return
        self.cache.copy_prefix(source, slot, length)

    @property
    def new_call_shapes(self) -> int:
        return self._calls.made

    def _call(self, start: int, rows: int, seq: int, n: int) -> _SegmentCall:
        return self._calls.use((start, rows, seq, n),
                               lambda: _SegmentCall(self, start, {"batch": rows, "seq": seq, "num_logits": n,
                                                                  "top_k": 1}))  # rank 0 reads only the logits


class _SegmentCall:
    """Every segment's IOBinding for one call shape. Values between segments are torch tensors on the
    rank's device, shared by the segment that writes them and those that read them and bound by pointer; a
    collective's output is its input's tensor. Each segment's own layers' KV rows are bound by the cache
    (past and present one memory, on the device). The step's inputs are tensors on the device too, copied
    into each step (`set`), but for `total_sequence_length`, which GroupQueryAttention reads on the host."""

    def __init__(self, engine: RankEngine, start: int, dims: dict[str, int]):
        self.device, self.total = engine.torch_device, np.zeros((), np.int32)  # total: HOST_READ, the longest length
        self.tensors: dict[str, torch.Tensor] = dict(engine.tables)
        # HOST_READ values, kept alive as long as the bindings; rank 0 reads logits only: TopK k is 1
        self._host = dict(zip(HOST_READ, (ort.OrtValue.ortvalue_from_numpy(self.total),
                                          ort.OrtValue.ortvalue_from_numpy(np.ones(1, np.int64)))))
        self.bindings, self.reduced = [], []
        for k, (session, seg) in enumerate(zip(engine.sessions, engine.segments)):
            binding = session.io_binding()
            for name, info in seg.inputs.items():
                if name in HOST_READ:
                    binding.bind_ortvalue_input(name, self._host[name])
                elif not name.startswith("past_"):
                    self._bind(binding.bind_input, engine, name, info, dims)
            for name, info in seg.outputs.items():
                if not name.startswith("present_"):
                    self._bind(binding.bind_output, engine, name, info, dims)
            engine.cache.bind(binding, start, start + dims["batch"], segment_layers(seg))
            self.bindings.append(binding)
            if k < len(engine.collectives):
                cut = engine.collectives[k]
                self.tensors[cut.output] = self.tensors[cut.input]
                self.reduced.append(self.tensors[cut.input])
        if engine.torch_device.type == "cuda":  # zeroed on torch's stream, read on ONNX Runtime's
            torch.cuda.synchronize(engine.torch_device)

    def _bind(self, bind, engine: RankEngine, name: str, info: dict, dims: dict) -> None:
        """Bind `name` (input or output, by `bind`) to its tensor on the rank's device, made on first use."""
        if name not in self.tensors:
            self.tensors[name] = torch.zeros(_shape(info, dims), dtype=TORCH_TYPES[info["dtype"]],
                                             device=engine.torch_device)
        tensor = self.tensors[name]
        device = engine.torch_device
        bind(name, device.type, device.index or 0, ELEMENT_TYPES[info["dtype"]], list(tensor.shape),
             tensor.data_ptr())

    def set(self, ids: np.ndarray, seqlens: np.ndarray, total: int, index: np.ndarray) -> None:
        """Write the step's inputs into the bound buffers: the device tensors in place (same addresses)."""
        self.total[...] = total
        for name, array in (("input_ids", ids), ("seqlens_k", seqlens), ("logits_index", index)):
            if name in self.tensors:
                self.tensors[name].copy_(torch.from_numpy(np.asarray(array)))
        if self.device.type == "cuda":  # written on torch's stream, read on ONNX Runtime's
            torch.cuda.synchronize(self.device)


def _shape(info: dict, dims: dict) -> list[int]:
    return [dims[d] if isinstance(d, str) else d for d in info["shape"]]


def _torch_table(table: np.ndarray, dtype: str) -> torch.Tensor:
    """A rotary table as a torch tensor of the engine's dtype (bfloat16 arrives as its bits)."""
    tensor = torch.from_numpy(np.ascontiguousarray(table))
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def segment_layers(segment: SegmentFile) -> list[int]:
    """The layers whose KV a segment reads and writes (its `past_key_i` inputs), in order."""
    return sorted(int(name.rsplit("_", 1)[1]) for name in segment.inputs if name.startswith("past_key_"))
