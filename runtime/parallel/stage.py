"""One pipeline stage process (ranks 1..P x T, as `python -m runtime.parallel.stage` processes): its layers' ONNX
segments (one; with tensor parallelism its tp rank's, cut at the stage's all-reduces, which it runs over its
stage's own group), a KV cache of its own layers (and heads) only, and the loop that runs each micro-batch rank
0 sends (a StageStep) on the hidden states the stage before sends, then hands its own on: to the next stage, or
the logits to rank 0.

With ENGINE_TP_TRACE set to a folder, each stage writes there (stage{s}.json) the seconds it spent waiting for
rank 0's steps, waiting for the hidden states, computing and sending (benchmarks: the bubble and the hand-off).

Sends are posted, not waited for (a stage goes on to the next micro-batch while the last one's hidden states
travel), from copies, since the next call of the same shape writes the bound buffers again. On cuda a stage's
sessions, KV cache and bound tensors are on the machine's GPU 0 (`placement`); what it receives and sends goes
through host tensors (gloo moves host memory)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.config import LoadConfig
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError, Manifest, read_manifest
from runtime.model.call_cache import CallCache
from runtime.model.device import open_session, providers
from runtime.model.kv_cache import KVCache
from runtime.model.ort_session import session_options
from runtime.model.weight_kernels import configure
from runtime.model.rotary import rope_tables
from runtime.parallel.processes import describe
from runtime.parallel.rank import TIMEOUT_S, TORCH_TYPES, TRACE_ENV, _SegmentCall, _torch_table, rank_providers
from runtime.parallel.stage_lora import StageAdapters, stage_inputs
from runtime.parallel.step import RELEASED
from runtime.parallel.stage_step import LOGITS, TAG, StageStep, receive

IDLE = datetime.timedelta(days=365)  # a stage waits this long for rank 0's next step
IN_FLIGHT = 8  # sends a stage leaves posted before it waits for the oldest


class StageKVCache(KVCache):
    """The KV buffers of a stage's own `layers` only, bound under those layers' names."""

    def __init__(self, spec: KVCacheSpec, layers: tuple[int, ...], *placement):
        super().__init__(dataclasses.replace(spec, num_layers=len(layers)), *placement)
        self.layers = tuple(layers)

    def bind(self, binding, start: int, stop: int, layers=None) -> None:
        local = [self.layers.index(layer) for layer in (self.layers if layers is None else layers)]
        super().bind(_Renamed(binding, self.layers), start, stop, local)


class _Renamed:
    """An IOBinding whose `past_/present_{key,value}_{i}` names are the stage's i-th layer's."""

    def __init__(self, binding, layers: tuple[int, ...]):
        self.binding, self.layers = binding, layers

    def __getattr__(self, attr: str):
        method = getattr(self.binding, attr)
        return lambda name, *args: method(self._name(name), *args)

    def _name(self, name: str) -> str:
        stem, _, i = name.rpartition("_")
        return f"{stem}_{self.layers[int(i)]}"


class StageEngine:
    """One process of a stage (`index` = its process rank - 1): the stage's tensor-parallel rank `tp_rank`'s
    segments, KV cache (its layers, its heads) and bound call buffers, and the stage's all-reduces between the
    segments over `group` (the stage's own tensor-parallel group; none without tensor parallelism). The
    attribute names are those `_SegmentCall` (runtime/parallel/rank.py) binds from."""

    def __init__(self, engine_dir: Path, manifest: Manifest, spec: KVCacheSpec, index: int, config: LoadConfig):
        section = manifest.pipeline_parallel
        stage, self.tp_rank = section.place(index + 1)
        self.stage, self.tp = section.stages[stage], section.tensor_parallel
        self.last = stage == section.size - 1
        self.returns = self.last and self.tp_rank == 0  # the one process that sends rank 0 the logits
        self.segments = self.stage.ranks[self.tp_rank].segments
        self.collectives, self.group = self.stage.collectives, None
        chosen, self.torch_device = placement(config.device, providers(manifest, config.device),
                                              torch.cuda.is_available())
        options = session_options(config.threads)
        configure(options, config.weight_kernels, manifest.target.weight_kernels, config.device)
        self.sessions = [open_session(engine_dir / segment.file, options, chosen) for segment in self.segments]
        layers = tuple(sorted({layer for segment in self.segments for layer in segment.layers}))
        self.cache = StageKVCache(spec, layers, config.device, config.kv_backend, STAGE_GPU)
        self.tables = {name: _torch_table(table, spec.dtype).to(self.torch_device) for name, table in
                       zip(("cos_cache", "sin_cache"), rope_tables(manifest.rope, spec.max_seq_len, spec.dtype))}
        self.adapters = None  # an engine built with `lora:`: this stage's layers' A/B, bound into every call
        self.lora_ids = manifest.lora.ids if manifest.lora is not None else None  # each token's adapter slot
        if manifest.lora is not None:
            shapes = {name: info["shape"] for segment in self.segments for name, info in segment.inputs.items()}
            self.adapters = StageAdapters(stage_inputs(section, index + 1), shapes, manifest.lora.max_adapters,
                                          self.torch_device)
            self.tables |= self.adapters.tensors
        self._calls = CallCache()

    def receive(self, call: _SegmentCall, group, source: int, timeout: datetime.timedelta) -> None:
        """The values the stage before sends (in the order it sends them) into the call's buffers: on a GPU
        through host tensors (gloo moves host memory), copied to the device before the segments read them."""
        for name in self.stage.receives:
            tensor = call.tensors[name]
            host = tensor if tensor.device.type == "cpu" else torch.empty(tensor.shape, dtype=tensor.dtype)
            group.recv([host], source, TAG).wait(timeout)
            if host is not tensor:
                tensor.copy_(host)
        if self.torch_device.type == "cuda":  # written on torch's stream, read on ONNX Runtime's
            torch.cuda.synchronize(self.torch_device)

    def run(self, call: _SegmentCall, timeout: datetime.timedelta) -> None:
        """Every segment, each but the last followed by its all-reduce over the stage's tensor-parallel group."""
        for k, (session, binding) in enumerate(zip(self.sessions, call.bindings)):
            session.run_with_iobinding(binding)
            if k < len(self.collectives):
                self.group.allreduce([call.reduced[k]]).wait(timeout)

    def call(self, step: StageStep) -> _SegmentCall:
        """The bound call of the step's shape, its inputs written, with a buffer for each value it receives
        (a value only forwarded is bound to no session)."""
        rows, seq = step.ids.shape
        dims = {"batch": rows, "seq": seq, "num_logits": len(step.index), "top_k": 1}
        call = self._calls.use((step.start, rows, seq, len(step.index)),
                               lambda: _SegmentCall(self, step.start, dims))
        for name, info in self.stage.receives.items():
            if name not in call.tensors:
                shape = [dims[d] if isinstance(d, str) else d for d in info["shape"]]
                call.tensors[name] = torch.zeros(shape, dtype=TORCH_TYPES[info["dtype"]])
        if self.lora_ids in call.tensors:  # [rows, seq]: each token's row's slot
            call.tensors[self.lora_ids].copy_(torch.from_numpy(step.adapters[:, None]).expand(rows, seq))
        call.set(step.ids, step.seqlens, step.total_len, step.index)
        return call

    def results(self, call: _SegmentCall, head: int) -> list[torch.Tensor]:
        """What the last stage returns: the logits, or for NEXT_TOKEN the ids the sampling head's ArgMax chose."""
        if head == LOGITS:
            return [call.tensors["logits"]]
        chosen = call.tensors.get("next_token")
        return [chosen.reshape(-1).to(torch.int64) if chosen is not None else call.tensors["logits"].argmax(-1)]

    def outgoing(self, call: _SegmentCall, head: int, rank: int) -> tuple[list[torch.Tensor], int]:
        """What this process (`rank`) sends after a step, and to which rank: from the last stage's tp rank 0 the
        logits (or ids) to rank 0, from its other tp ranks nothing, else the boundary values to the next stage's
        process of the same tp rank."""
        if self.returns:
            return self.results(call, head), 0
        if self.last:
            return [], 0
        return [call.tensors[name] for name in self.stage.sends], rank + self.tp

    def replay(self, copies) -> None:
        """Rank 0's KV prefix copies (and rows handed back, from RELEASED) on this stage's layers."""
        for source, slot, length in copies:
            if source == RELEASED:
                self.cache.release_row(slot, length)
            else:
                self.cache.copy_prefix(source, slot, length)


STAGE_GPU = 0  # every stage process of a cuda engine on this machine computes on its GPU 0 (gloo shares it)


def placement(device: str, chosen: list, cuda_in_torch: bool) -> tuple[list, torch.device]:
    """A stage's ONNX Runtime providers (`chosen`, runtime/model/device.py `providers`, CUDA's on STAGE_GPU) and
    the device its boundary and step tensors live on: STAGE_GPU on cuda (where torch must have CUDA: a host
    tensor bound to a CUDA session reaches the GPU once, at binding), host memory on cpu. Hidden states cross
    between stages through host tensors over gloo."""
    if device != "cuda":
        return chosen, torch.device("cpu")
    if not cuda_in_torch:
        raise EngineError(f"a pipeline stage on cuda keeps its step and boundary tensors on the GPU through torch, "
                          f"and this torch {torch.__version__} has no CUDA: install a CUDA build of torch or load "
                          f"with device='cpu'")
    return rank_providers(chosen, STAGE_GPU), torch.device("cuda", STAGE_GPU)


def serve(engine: StageEngine, group, rank: int) -> None:
    """A stage process's loop until rank 0 sends STOP: a step from rank 0, the hidden states from the stage
    before (its process of the same tp rank, `rank - tp`; the first stage reads token ids), run (all-reducing
    within the stage), post the result to the next stage's process of the same tp rank (or, from the last
    stage's tp rank 0, the logits to rank 0). Every tp rank of a stage receives and sends the same hidden
    states: after an all-reduce they are equal on all of them, and T pairs of sends need no broadcast."""
    posted: deque = deque()
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    seconds = dict.fromkeys(("step", "hidden", "compute", "send"), 0.0)  # where the stage's time went (benchmarks)
    clock = time.perf_counter()
    while not (step := receive(group, IDLE)).stop:
        clock = _lap(seconds, "step", clock)
        if step.new_slots:  # those slots' blocks of this stage's A/B, sent right after the step
            engine.adapters.receive(step.new_slots, group, TAG, timeout)
        engine.replay(step.copies)
        call = engine.call(step)
        engine.receive(call, group, rank - engine.tp, timeout)
        clock = _lap(seconds, "hidden", clock)
        engine.run(call, timeout)
        clock = _lap(seconds, "compute", clock)
        outgoing, target = engine.outgoing(call, step.head, rank)
        for tensor in outgoing:
            tensor = tensor.to("cpu", copy=True)  # the next call of this shape writes the buffer again
            posted.append((group.send([tensor], target, TAG), tensor))
        while len(posted) > IN_FLIGHT or posted and posted[0][0].is_completed():
            posted.popleft()[0].wait(timeout)
        clock = _lap(seconds, "send", clock)
    while posted:
        posted.popleft()[0].wait(timeout)
    if os.environ.get(TRACE_ENV):
        Path(os.environ[TRACE_ENV], f"stage{rank - 1}.json").write_text(json.dumps(seconds))


def _lap(seconds: dict, part: str, since: float) -> float:
    now = time.perf_counter()
    seconds[part] += now - since
    return now


def _main(engine_dir: str, index: int, world: int, port: int, spec: dict, config: LoadConfig) -> None:
    """A spawned stage process (rank index + 1): load, join its stage's tensor-parallel group, tell rank 0 it is
    ready, serve until STOP."""
    rank, name = index + 1, f"rank {index + 1}"
    try:
        directory = Path(engine_dir)
        manifest = read_manifest(directory, check_files=False)
        stage, tp_rank = manifest.pipeline_parallel.place(rank)
        name = describe(manifest.pipeline_parallel.tensor_parallel, rank)
        store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=TIMEOUT_S))
        engine = StageEngine(directory, manifest, KVCacheSpec.from_dict(spec), index, config)
        store.set(f"ready/{rank}", "1")
        group = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=TIMEOUT_S))
        if engine.collectives:
            engine.group = stage_group(store, stage, tp_rank, engine.tp)
        serve(engine, group, rank)
    except RuntimeError as err:  # rank 0 or a neighbour died, or a receive timed out: leave, do not hang
        print(f"engine-pp {name}: stopping: {err}", file=sys.stderr)
        sys.exit(1)


def stage_group(store, stage: int, tp_rank: int, tp: int):
    """The stage's own tensor-parallel group (gloo: the all-reduces of its segments), under a store prefix of
    its own so that the stages' groups do not meet."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"stage{stage}/", store), tp_rank, tp,
                                 datetime.timedelta(seconds=TIMEOUT_S))


if __name__ == "__main__":  # started by PipelineRunner: ENGINE_DIR INDEX WORLD PORT SPEC_JSON LOAD_CONFIG_JSON
    import json

    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]),
          LoadConfig.from_json(sys.argv[6]))
