"""ModelRunner: one ONNX Runtime session over the engine graph, run on a contiguous range of KV
slots through IOBinding so that past and present KV share the cache's memory (updated in place)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime.config import LoadConfig
from runtime.lora.pool import AdapterPool
from runtime.model.call_cache import CallCache
from runtime.model.device import HOST_READ, open_session, providers
from runtime.model.kv_cache import ONNX_TYPES, KVCache
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import Manifest, check_graph
from runtime.model.ort_session import on_process_pool, session_options
from runtime.model.weight_kernels import configure
from runtime.model.rotary import rope_tables
from runtime.model.runner import Runner

HIDDEN_INDEX = "hidden_index"  # builder/passes/append_hidden_output.py INDEX


class _Call:
    """One call shape's IOBinding with every input and output bound once to buffers of its own (the KV
    to views of the cache, past and present the same memory): a call only writes the small inputs in
    place and runs, with no per-call allocation or binding.

    The step's inputs live on the session's device at fixed addresses (what a CUDA graph replays) and are
    written each call (`update_inplace`), on CPU too, so CI runs the CUDA path; only HOST_READ inputs are
    bound from host memory. The rotary tables are the runner's, one device copy for every call shape."""

    def __init__(self, runner: ModelRunner, start: int, rows: int, seq: int, n: int, head: str, features: int = 0):
        """`features`: positions whose last hidden state the call also returns (an EAGLE engine's `hidden_states`
        output, gathered at `hidden_index`; 0: an empty index, nothing fetched)."""
        device = runner.cache.device
        self.ids = np.zeros((rows, seq), np.int64)
        self.seqlens = np.zeros(rows, np.int32)
        self.total = np.zeros((), np.int32)  # HOST_READ
        # HOST_READ, fixed per call: TopK's k, 1 unless this call reads the candidates (ORT runs TopK anyway)
        k = np.array([runner.top_k if head == "topk" else 1], np.int64)
        self.index = np.zeros(n, np.int64)
        self.lora_ids = np.zeros((rows, seq), np.int64)  # each token's adapter slot (an engine with LoRA inputs)
        outputs = {"logits": {"logits": np.zeros((n, runner.vocab_size), np.float32)},
                   "next_token": {"next_token": np.zeros(n, np.int64)},
                   "topk": {"topk_values": np.zeros((n, runner.top_k), np.float32),
                            "topk_indices": np.zeros((n, runner.top_k), np.int64)}}[head]
        self.features = np.zeros(features, np.int64)  # hidden_index: flat positions, as logits_index
        if features:  # the target's last hidden state there, for an EAGLE head (runtime/speculation/eagle.py)
            outputs["hidden_states"] = np.zeros((features, runner.hidden_size), np.float32)
        self.outputs = list(outputs.values())
        staged = {"input_ids": self.ids, "seqlens_k": self.seqlens, "logits_index": self.index}
        if runner.has_hidden:
            staged[HIDDEN_INDEX] = self.features
        if runner.lora is not None:
            staged[runner.lora.lora.ids] = self.lora_ids
        inputs = {name: _buffer(a, device) for name, a in staged.items()}
        self._staged = [(inputs[name], a) for name, a in staged.items()]
        inputs.update({name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in zip(HOST_READ, (self.total, k))})
        inputs.update(runner.tables)
        inputs.update(runner.lora_values)
        # only the inputs the session declares: a family's graph may compute its rotary tables itself
        self._inputs = {name: v for name, v in inputs.items() if name in runner.input_names}  # alive with the binding
        # outputs: on CPU the numpy arrays themselves; on a device, buffers there copied back after the call
        self._outputs = {name: ort.OrtValue.ortvalue_from_numpy(a) if device == "cpu" else _buffer(a, device)
                         for name, a in outputs.items()}
        self._fetched = [] if device == "cpu" else list(zip(self._outputs.values(), self.outputs))
        self.binding = runner.session.io_binding()
        for name, value in self._inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        for name, value in self._outputs.items():  # only the outputs this call reads (no logits copy)
            self.binding.bind_ortvalue_output(name, value)
        runner.cache.bind(self.binding, start, start + rows)

    def run(self, session: ort.InferenceSession, options: ort.RunOptions | None) -> None:
        for value, host in self._staged:
            value.update_inplace(host)  # same address: the next call (or a captured graph) reads the new values
        session.run_with_iobinding(self.binding, options)
        for value, host in self._fetched:
            host[...] = value.numpy()


class ModelRunner(Runner):
    """Runs the engine on rows `[start, stop)` of the KV cache (runtime/model/runner.py) with one session."""

    def __init__(self, engine_dir: Path, manifest: Manifest, spec: KVCacheSpec, config: LoadConfig = LoadConfig(),
                 spinning: bool = True):
        """`config.device` is the device to run on (default: the engine's target); `spinning`: whether
        ONNX Runtime's threads may spin between calls (not when a draft and its target take turns)."""
        device = config.device or manifest.target.device
        self.on_process_pool = on_process_pool()
        buckets = graph_buckets(manifest, spec, device, config.graph_decode)
        options = session_options(config.threads, spinning)
        self.weight_kernels = configure(options, config.weight_kernels, manifest.target.weight_kernels, device)
        self.session = open_session(engine_dir / "model.onnx", options, session_providers(manifest, device, buckets))
        self.input_names = {i.name for i in self.session.get_inputs()}
        check_graph(manifest, self.session.get_inputs(), self.session.get_outputs())  # runtime/manifest/load.py
        super().__init__(engine_dir, manifest, spec, KVCache(spec, device, config.kv_backend),
                         config.buckets_on(device))
        self.graph_buckets = buckets
        self.tables = rotary_values(manifest, spec, device)
        if manifest.lora is not None:
            self.lora = AdapterPool(manifest.lora, spec.slots)
        self.lora_values = lora_values(self.lora, device)
        self._lora_version = self.lora.version if self.lora is not None else 0
        outputs = {o.name: o for o in self.session.get_outputs()}
        # the builder's sampling head (manifest "sampling_head"): ArgMax ids and TopK candidates; 0 = none
        self.has_next_token = "next_token" in outputs
        self.top_k = manifest.sampling_head.max_top_k if "topk_values" in outputs else 0
        # for an EAGLE head: hidden_states at positions of its own (builder/passes/append_hidden_output.py)
        self.has_hidden = "hidden_states" in outputs and HIDDEN_INDEX in self.input_names
        self.hidden_size = manifest.model.hyperparameters["hidden_size"]
        self._calls = CallCache()  # (start, rows, seq, n, head, features) -> _Call
        self._graph_calls: dict[tuple[int, str], tuple[_Call, ort.RunOptions | None]] = {}
        self.eager_options = run_options(EAGER if self._captures else None)

    @property
    def _captures(self) -> bool:
        """Whether the session captures CUDA graphs (decode buckets on CUDA)."""
        return bool(self.graph_buckets) and self.cache.device == "cuda"

    @property
    def new_call_shapes(self) -> int:
        """Call shapes bound so far: a call that binds one is slower than the next of its shape."""
        return self._calls.made + len(self._graph_calls)

    def run(self, start: int, input_ids: np.ndarray, seqlens_k: np.ndarray, total_len: int,
            logits_index: np.ndarray, head: str = "logits", features: np.ndarray | None = None):
        """Runner.run on this session's buffers bound for the call shape."""
        self._check_head(head)
        if head == "hidden":  # the logits and the features at the same positions
            head, features = "logits", logits_index
        rows, seq = input_ids.shape
        call = self._call(start, rows, seq, len(logits_index), head, 0 if features is None else len(features))
        call.ids[...] = input_ids
        call.seqlens[...] = seqlens_k
        call.total[...] = total_len
        call.index[...] = logits_index
        if features is not None:
            call.features[...] = features
        self._feed_lora(call, start)
        call.run(self.session, self.eager_options)
        # the buffers are reused by the next call of this shape; the KV stays in place
        outputs = [o.copy() for o in call.outputs]
        out = tuple(outputs[:2]) if head == "topk" else outputs[0]
        return out if features is None else (out, outputs[-1])

    def _feed_lora(self, call: _Call, start: int) -> None:
        """Each token's adapter slot from its row's (AdapterPool.rows), and the adapters' A/B when they changed."""
        if self.lora is None:
            return
        call.lora_ids[...] = self.lora.rows[start:start + len(call.lora_ids), None]
        if self._lora_version != self.lora.version:
            self._lora_version = self.lora.version
            for name, value in self.lora_values.items():
                value.update_inplace(self.lora.arrays[name])

    def _call(self, start: int, rows: int, seq: int, n: int, head: str, features: int = 0) -> _Call:
        """The bound buffers for one call shape, made once (the most recent shapes are kept: CallCache)."""
        return self._calls.use((start, rows, seq, n, head, features),
                               lambda: _Call(self, start, rows, seq, n, head, features))

    def _graph_decode(self, tokens: np.ndarray, past_lens: np.ndarray, head: str):
        """A decode over rows [0, bucket) on buffers bound once; total_sequence_length is fixed at the KV
        length (seqlens_k carries each row's). The first call of a bucket captures its graph on CUDA."""
        rows = len(tokens)
        key = (rows, head)
        if key not in self._graph_calls:
            graph_id = len(self._graph_calls) + 1 if self._captures else None
            self._graph_calls[key] = (_Call(self, 0, rows, 1, rows, head), run_options(graph_id))
        call, options = self._graph_calls[key]
        call.ids[:, 0] = tokens
        call.seqlens[...] = past_lens
        call.total[...] = self.spec.max_seq_len
        call.index[...] = np.arange(rows)
        self._feed_lora(call, 0)
        call.run(self.session, options)
        outputs = [o.copy() for o in call.outputs]
        return tuple(outputs) if head == "topk" else outputs[0]

    def decode(self, start: int, tokens: np.ndarray, past_lens: np.ndarray, head: str = "logits",
               features: np.ndarray | None = None):
        """Runner.decode, on the fixed buffers of a graph bucket when the batch fills one from slot 0 (a call
        that returns features runs eager: which rows want them changes from step to step)."""
        if start == 0 and len(tokens) in self.graph_buckets and features is None:
            self._check_head(head)
            return self._graph_decode(np.asarray(tokens), past_lens, head)
        return super().decode(start, tokens, past_lens, head, features)


def _buffer(like: np.ndarray, device: str) -> ort.OrtValue:
    """A buffer of `like`'s shape and type allocated by ONNX Runtime on `device` (its address never changes)."""
    return ort.OrtValue.ortvalue_from_shape_and_type(list(like.shape), like.dtype.type, device, 0)


EAGER = -1  # gpu_graph_id of a call that runs without capture on a session that captures CUDA graphs


def run_options(graph_id: int | None) -> ort.RunOptions | None:
    """Run options of a call: on a capturing session, the call's CUDA graph (`graph_id` >= 1, one per decode
    bucket and head) or none (EAGER); None on a session that captures nothing. (ONNX Runtime 1.32's Python
    run_with_iobinding looks up gpu_graph_id in the options it is given, and a missing entry costs a C++
    exception, ~25 us per call: a fifth of a small model's step. `only_execute_path_to_fetches` would skip
    the TopK of a greedy step, but ONNX Runtime honours it only in training builds: a greedy call passes
    top_k = 1 instead, see _Call.)"""
    if graph_id is None:
        return None
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


def session_providers(manifest: Manifest, device: str, buckets: list[int]) -> list:
    """One session serves eager calls and captured decode graphs: on CUDA with graph buckets it is made with
    `enable_cuda_graph`, and eager calls run with gpu_graph_id EAGER (ONNX Runtime's "skip capture"), so the
    weights are on the GPU once, not once per session."""
    chosen = providers(manifest, device)
    if buckets and device == "cuda":
        chosen[0] = (chosen[0], {"enable_cuda_graph": "1"})
    return chosen


def graph_buckets(manifest: Manifest, spec: KVCacheSpec, device: str, graph_decode: bool | None) -> list[int]:
    """Decode batch buckets run on fixed buffers (CUDA: one captured graph each): the manifest's
    `cuda_graphs` buckets up to the loaded slot count, plus that count. `graph_decode` None follows the
    manifest on CUDA (off on CPU); True runs the fixed-buffer path on any device (on CPU without capture,
    so CI proves it gives the same tokens), with [1, 2, 4, ...] when the manifest has no buckets."""
    plan = manifest.cuda_graphs
    wanted = plan.enabled and device == "cuda" if graph_decode is None else graph_decode
    if not wanted:
        return []
    sizes = plan.batch_sizes or [2 ** i for i in range(7)]
    return sorted({b for b in sizes if b <= spec.slots} | {spec.slots})


def lora_values(pool: AdapterPool | None, device: str) -> dict[str, ort.OrtValue]:
    """The adapters' stacked A/B inputs on the device (zeros until an adapter loads), one copy for every call."""
    if pool is None:
        return {}
    values = {name: _buffer(array, device) for name, array in pool.arrays.items()}
    for name, value in values.items():
        value.update_inplace(pool.arrays[name])
    return values


def rotary_values(manifest: Manifest, spec: KVCacheSpec, device: str) -> dict[str, ort.OrtValue]:
    """cos_cache / sin_cache [max_seq_len, head_dim/2] on the device, once for every call shape (a copy per
    shape would cost ~2 GB at a 131k max_seq_len); bfloat16 tables arrive as their bits."""
    values = {}
    for name, table in zip(("cos_cache", "sin_cache"), rope_tables(manifest.rope, spec.max_seq_len, spec.dtype)):
        element = ONNX_TYPES[spec.dtype]
        values[name] = ort.OrtValue.ortvalue_from_shape_and_type(list(table.shape), element, device, 0)
        values[name].update_inplace(np.ascontiguousarray(table))
    return values
