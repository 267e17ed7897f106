"""ModelRunner: one ONNX Runtime session over the engine graph, run on a contiguous range of KV
slots through IOBinding so that past and present KV share the cache's memory (updated in place)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime.kv_cache import KVCache
from runtime.kv_spec import KVCacheSpec
from runtime.manifest import check_graph


def rope_tables(rope: dict, length: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches [length, head_dim/2] the way transformers computes them in float32."""
    inv_freq = np.asarray(rope["inv_freq"], dtype=np.float32)
    freqs = np.outer(np.arange(length, dtype=np.float32), inv_freq).astype(np.float32)
    scale = np.float32(rope["attention_scaling"])
    cos, sin = np.cos(freqs) * scale, np.sin(freqs) * scale
    if dtype == "bfloat16":  # numpy has no bfloat16: the bits, bound with ONNX element type 16
        return bfloat16_bits(cos), bfloat16_bits(sin)
    return cos.astype(dtype), sin.astype(dtype)


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even like torch's conversion."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def session_options(threads: int | None, spinning: bool = True) -> ort.SessionOptions:
    """`spinning` False: idle intra-op threads sleep at once instead of spinning for more work. Two sessions
    that take turns on the same cores (a target and its draft) must not spin: measured on 2 cores, the
    other session's spinning threads made a 3M-parameter target's decode call 1.8x and its verify call
    1.8x slower. Once `use_process_pool` has run, every session runs on that pool instead (ONNX Runtime
    refuses a session with threads of its own from then on); `threads` and `spinning` are then the pool's."""
    options = ort.SessionOptions()
    if on_process_pool():
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


_process_pool_threads: int | None = None  # set once: ONNX Runtime's process-wide pool cannot be resized


def use_process_pool(threads: int | None) -> int:
    """From now on, run every ONNX Runtime session of this process on one process-wide intra-op pool of
    `threads` threads (the first call decides the size; returns it). ONNX Runtime then refuses sessions
    with threads of their own, this library's and any other's, so this is opt-in
    (`LLM(process_thread_pool=True)`), for processes that serve a target with its draft: the two take
    turns on the same cores, and one spinning pool beats both two spinning pools and two quiet ones.
    Measured on 2 cores with the trained 3M-parameter target and its 1.4M draft, 3 draft steps + a
    4-token verify: 1.78 ms on one pool, 2.13 ms on two non-spinning pools, 2.46 ms on two spinning ones."""
    global _process_pool_threads
    if _process_pool_threads is None:
        _process_pool_threads = threads or os.cpu_count() or 1
        ort.set_global_thread_pool_sizes(_process_pool_threads, 1)
    return _process_pool_threads


def on_process_pool() -> bool:
    return _process_pool_threads is not None


MAX_CALLS = 64  # call shapes whose buffers stay bound: decode and verify shapes recur, prompt shapes vary


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


class ModelRunner:
    """Runs the engine on rows `[start, stop)` of the KV cache.

    A call is either a first prompt for all its rows (seq > 1, positions from 0), a decode step
    (seq == 1, each row at its own length) or, at batch 1, a chunk on top of an existing past."""

    def __init__(self, engine_dir: Path, manifest: dict, spec: KVCacheSpec, threads: int | None = None,
                 providers: list[str] | None = None, spinning: bool = True, device: str = "cpu",
                 kv_backend: str | None = None, graph_decode: bool | None = None):
        self.engine_dir, self.spec, self.manifest = engine_dir, spec, manifest
        self.dtype = spec.dtype
        self.on_process_pool = on_process_pool()
        self.session = ort.InferenceSession(str(engine_dir / "model.onnx"), session_options(threads, spinning),
                                            providers=providers or ["CPUExecutionProvider"])
        self.input_names = {i.name for i in self.session.get_inputs()}
        check_graph(manifest, self.session.get_inputs(), self.session.get_outputs())  # runtime/manifest.py
        self.cache = KVCache(spec, device, kv_backend)
        self.cos, self.sin = rope_tables(manifest["rope"], spec.max_seq_len, spec.dtype)
        self.vocab_size = manifest["model"]["hyperparameters"]["vocab_size"]
        outputs = {o.name: o for o in self.session.get_outputs()}
        # the builder's sampling head (manifest "sampling_head"): ArgMax ids and TopK candidates; 0 = none
        self.has_next_token = "next_token" in outputs
        self.top_k = int(outputs["topk_values"].shape[-1]) if "topk_values" in outputs else 0
        self._calls: dict[tuple[int, int, int, int, str], _Call] = {}
        self.graph_buckets = self._graph_buckets(graph_decode)
        self._graph_calls: dict[tuple[int, str], tuple[_Call, ort.RunOptions | None]] = {}
        self.graph_session = self._graph_session(threads, spinning) if self.graph_buckets else None
        self.new_call_shapes = 0  # bindings made so far: a call that makes one is slower than the next of its shape

    def run(self, start: int, input_ids: np.ndarray, seqlens_k: np.ndarray, total_len: int,
            logits_index: np.ndarray, head: str = "logits"):
        """input_ids [rows, seq]; seqlens_k [rows] = each row's total length - 1 (GQA convention);
        total_len = the batch maximum of total lengths; logits_index [n] flat indices into
        rows*seq. KV rows [start, start+rows) are updated in place. Returns, per `head`: "logits" float32
        [n, vocab]; "next_token" int64 [n] (the graph's ArgMax); "topk" (values float32 [n, K], ids int64
        [n, K]), the graph's TopK, sorted largest first. The last two need the engine's sampling head."""
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

    def _check_head(self, head: str) -> None:
        if head == "next_token" and not self.has_next_token or head == "topk" and not self.top_k:
            raise ValueError(f"this engine has no sampling head output for {head!r}; use head='logits'")

    def _call(self, start: int, rows: int, seq: int, n: int, head: str) -> _Call:
        """The bound buffers for one call shape, made once (the most recent MAX_CALLS shapes are kept)."""
        key = (start, rows, seq, n, head)
        call = self._calls.pop(key, None)
        if call is None:
            call = _Call(self, start, rows, seq, n, head)
            self.new_call_shapes += 1
        self._calls[key] = call  # most recently used last
        if len(self._calls) > MAX_CALLS:
            del self._calls[next(iter(self._calls))]
        return call

    def _graph_buckets(self, graph_decode: bool | None) -> list[int]:
        """Decode batch buckets run on fixed buffers (CUDA: one captured graph each): the manifest's
        `cuda_graphs` buckets up to the loaded slot count, plus that count. `graph_decode` None follows the
        manifest on CUDA (off on CPU); True runs the fixed-buffer path on any device (on CPU without capture,
        so CI proves it gives the same tokens), with [1, 2, 4, ...] when the manifest has no buckets."""
        plan = self.manifest.get("cuda_graphs") or {}
        wanted = plan.get("enabled", False) and self.cache.device == "cuda" if graph_decode is None else graph_decode
        if not wanted:
            return []
        sizes = plan.get("batch_sizes") or [2 ** i for i in range(7)]
        return sorted({b for b in sizes if b <= self.spec.slots} | {self.spec.slots})

    def _graph_session(self, threads: int | None, spinning: bool) -> ort.InferenceSession:
        """The session that replays decode graphs: on CUDA a second session with `enable_cuda_graph` (prefill,
        chunks and verify stay eager on the first; both bind the same KV buffers); on CPU the eager one."""
        if self.cache.device == "cpu":
            return self.session
        return ort.InferenceSession(str(self.engine_dir / "model.onnx"), session_options(threads, spinning),
                                    providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])

    def bucket(self, rows: int) -> int | None:
        """The smallest graph bucket holding `rows` decode rows from slot 0, or None (eager)."""
        return next((b for b in self.graph_buckets if b >= rows), None)

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
            self.new_call_shapes += 1
        call, options = self._graph_calls[key]
        call.ids[:, 0] = tokens
        call.seqlens[...] = past_lens
        call.total[...] = self.spec.max_seq_len
        call.index[...] = np.arange(rows)
        call.run(self.graph_session, options)
        outputs = [o.copy() for o in call.outputs]
        return tuple(outputs) if head == "topk" else outputs[0]

    def prefill(self, start: int, prompts: list[list[int]]) -> np.ndarray:
        """First prompt of rows start.. (positions from 0); returns each row's last logits [rows, vocab]."""
        lens = np.array([len(p) for p in prompts])
        seq = int(lens.max())
        ids = np.zeros((len(prompts), seq), dtype=np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
        last = np.arange(len(prompts)) * seq + lens - 1
        return self.run(start, ids, lens - 1, seq, last)

    def extend(self, slot: int, past_len: int, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Append `tokens` to one row that already holds `past_len` tokens (chunked prefill, verify).
        Returns logits for every new token [n, vocab] or only the last [1, vocab]."""
        n = len(tokens)
        total = past_len + n
        index = np.arange(n) if all_logits else np.array([n - 1])
        ids = np.asarray(tokens, dtype=np.int64)[None, :]
        return self.run(slot, ids, np.array([total - 1]), total, index)

    def decode(self, start: int, tokens: np.ndarray, past_lens: np.ndarray, head: str = "logits"):
        """One new token per row for rows start..; past_lens [rows]; returns logits [rows, vocab] (or the
        sampling head's outputs, see `run`)."""
        rows = len(tokens)
        if start == 0 and rows in self.graph_buckets:
            self._check_head(head)
            return self._graph_decode(np.asarray(tokens), past_lens, head)
        return self.run(start, np.asarray(tokens).reshape(rows, 1), past_lens,
                        int(past_lens.max()) + 1, np.arange(rows), head)
