"""ModelRunner: one ONNX Runtime session over the engine graph, run on a contiguous range of KV
slots through IOBinding so that past and present KV share the cache's memory (updated in place)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime.config import LoadConfig
from runtime.model.call_cache import CallCache
from runtime.model.device import providers
from runtime.model.kv_cache import KVCache
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import Manifest, check_graph
from runtime.model.ort_session import on_process_pool, session_options
from runtime.model.rotary import rope_tables
from runtime.model.runner import Runner


class _Call:
    """One call shape's IOBinding with every input and output bound once to buffers of its own (the KV
    to views of the cache, past and present the same memory): a call only writes the small inputs in
    place and runs, with no per-call allocation or binding."""

    def __init__(self, runner: ModelRunner, start: int, rows: int, seq: int, n: int, head: str,
                 session: ort.InferenceSession | None = None):
        self.device = runner.cache.device
        self.ids = np.zeros((rows, seq), np.int64)
        self.seqlens = np.zeros(rows, np.int32)
        self.total = np.zeros((), np.int32)
        self.index = np.zeros(n, np.int64)
        outputs = {"logits": {"logits": np.zeros((n, runner.vocab_size), np.float32)},
                   "next_token": {"next_token": np.zeros(n, np.int64)},
                   "topk": {"topk_values": np.zeros((n, runner.top_k), np.float32),
                            "topk_indices": np.zeros((n, runner.top_k), np.int64)}}[head]
        self.outputs = list(outputs.values())
        inputs = {"input_ids": self.ids, "seqlens_k": self.seqlens, "total_sequence_length": self.total,
                  "logits_index": self.index, "cos_cache": runner.cos, "sin_cache": runner.sin}
        # only the inputs the session declares: a family's graph may compute its rotary tables itself
        inputs = {name: a for name, a in inputs.items() if name in runner.input_names}
        # on CUDA every buffer but the host-side total length lives on the device, at a fixed address (what a
        # CUDA graph replays); on CPU the numpy arrays themselves are bound, so writing them is the update
        on_host = {"total_sequence_length"} if self.device != "cpu" else set(inputs) | set(outputs)
        bf16 = {"cos_cache", "sin_cache"} if runner.dtype == "bfloat16" else set()
        on_host |= bf16  # rotary tables in bfloat16 are bound as host bits (ONNX Runtime copies them in)
        self._values = {name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a, 16) if name in bf16 else
                        ort.OrtValue.ortvalue_from_numpy(a, *(("cpu", 0) if name in on_host else (self.device, 0)))
                        for name, a in {**inputs, **outputs}.items()}
        self._staged = [(self._values[name], a) for name, a in inputs.items() if name not in on_host
                        and name not in ("cos_cache", "sin_cache")]
        self._fetched = [(self._values[name], a) for name, a in outputs.items() if name not in on_host]
        self.binding = (session or runner.session).io_binding()
        for name in inputs:
            self.binding.bind_ortvalue_input(name, self._values[name])
        for name in outputs:  # only the outputs this call reads: the sampling head spares the logits copy
            self.binding.bind_ortvalue_output(name, self._values[name])
        runner.cache.bind(self.binding, start, start + rows)

    def run(self, session: ort.InferenceSession, options: ort.RunOptions | None) -> None:
        for value, host in self._staged:
            value.update_inplace(host)  # same device address: a captured graph reads the new values
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
        self.session = ort.InferenceSession(str(engine_dir / "model.onnx"), session_options(config.threads, spinning),
                                            providers=providers(manifest, device))
        self.input_names = {i.name for i in self.session.get_inputs()}
        check_graph(manifest, self.session.get_inputs(), self.session.get_outputs())  # runtime/manifest/load.py
        super().__init__(engine_dir, manifest, spec, KVCache(spec, device, config.kv_backend))
        self.cos, self.sin = rope_tables(manifest.rope, spec.max_seq_len, spec.dtype)
        outputs = {o.name: o for o in self.session.get_outputs()}
        # the builder's sampling head (manifest "sampling_head"): ArgMax ids and TopK candidates; 0 = none
        self.has_next_token = "next_token" in outputs
        self.top_k = int(outputs["topk_values"].shape[-1]) if "topk_values" in outputs else 0
        self._calls = CallCache()  # (start, rows, seq, n, head) -> _Call
        self.graph_buckets = self._graph_buckets(config.graph_decode)
        self._graph_calls: dict[tuple[int, str], tuple[_Call, ort.RunOptions | None]] = {}
        self.graph_session = self._graph_session(config.threads, spinning) if self.graph_buckets else None

    @property
    def new_call_shapes(self) -> int:
        """Call shapes bound so far: a call that binds one is slower than the next of its shape."""
        return self._calls.made + len(self._graph_calls)

    def run(self, start: int, input_ids: np.ndarray, seqlens_k: np.ndarray, total_len: int,
            logits_index: np.ndarray, head: str = "logits"):
        """Runner.run on this session's buffers bound for the call shape."""
        self._check_head(head)
        rows, seq = input_ids.shape
        call = self._call(start, rows, seq, len(logits_index), head)
        call.ids[...] = input_ids
        call.seqlens[...] = seqlens_k
        call.total[...] = total_len
        call.index[...] = logits_index
        call.run(self.session, None)
        # the buffers are reused by the next call of this shape; the KV stays in place
        outputs = [o.copy() for o in call.outputs]
        return tuple(outputs) if head == "topk" else outputs[0]

    def _call(self, start: int, rows: int, seq: int, n: int, head: str) -> _Call:
        """The bound buffers for one call shape, made once (the most recent shapes are kept: CallCache)."""
        return self._calls.use((start, rows, seq, n, head), lambda: _Call(self, start, rows, seq, n, head))

    def _graph_buckets(self, graph_decode: bool | None) -> list[int]:
        """Decode batch buckets run on fixed buffers (CUDA: one captured graph each): the manifest's
        `cuda_graphs` buckets up to the loaded slot count, plus that count. `graph_decode` None follows the
        manifest on CUDA (off on CPU); True runs the fixed-buffer path on any device (on CPU without capture,
        so CI proves it gives the same tokens), with [1, 2, 4, ...] when the manifest has no buckets."""
        plan = self.manifest.cuda_graphs
        wanted = plan.enabled and self.cache.device == "cuda" if graph_decode is None else graph_decode
        if not wanted:
            return []
        sizes = plan.batch_sizes or [2 ** i for i in range(7)]
        return sorted({b for b in sizes if b <= self.spec.slots} | {self.spec.slots})

    def _graph_session(self, threads: int | None, spinning: bool) -> ort.InferenceSession:
        """The session that replays decode graphs: on CUDA a second session with `enable_cuda_graph` (prefill,
        chunks and verify stay eager on the first; both bind the same KV buffers); on CPU the eager one."""
        if self.cache.device == "cpu":
            return self.session
        return ort.InferenceSession(str(self.engine_dir / "model.onnx"), session_options(threads, spinning),
                                    providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])

    def _graph_decode(self, tokens: np.ndarray, past_lens: np.ndarray, head: str):
        """A decode over rows [0, bucket) on buffers bound once; total_sequence_length is fixed at the KV
        length (seqlens_k carries each row's). The first call of a bucket captures its graph on CUDA."""
        rows = len(tokens)
        key = (rows, head)
        if key not in self._graph_calls:
            options = None
            if self.cache.device != "cpu":
                options = ort.RunOptions()
                options.add_run_config_entry("gpu_graph_id", str(len(self._graph_calls) + 1))
            self._graph_calls[key] = (_Call(self, 0, rows, 1, rows, head, self.graph_session), options)
        call, options = self._graph_calls[key]
        call.ids[:, 0] = tokens
        call.seqlens[...] = past_lens
        call.total[...] = self.spec.max_seq_len
        call.index[...] = np.arange(rows)
        call.run(self.graph_session, options)
        outputs = [o.copy() for o in call.outputs]
        return tuple(outputs) if head == "topk" else outputs[0]

    def decode(self, start: int, tokens: np.ndarray, past_lens: np.ndarray, head: str = "logits"):
        """Runner.decode, on the fixed buffers of a graph bucket when the batch fills one from slot 0."""
        if start == 0 and len(tokens) in self.graph_buckets:
            self._check_head(head)
            return self._graph_decode(np.asarray(tokens), past_lens, head)
        return super().decode(start, tokens, past_lens, head)
