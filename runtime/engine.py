"""The embeddable Python API: load an engine directory, generate for a batch of prompts, stream
text for one prompt. An engine step is schedule -> run -> postprocess."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence as Seq

from tokenizers import Tokenizer

try:
    import onnxruntime  # noqa: F401  (imported here, not in runtime/__init__, so a CLI's interrupt guard comes first)
except ImportError as error:
    raise ImportError("the runtime needs ONNX Runtime, which is not installed: pip install \".[cpu]\" (or "
                      "onnxruntime) on a CPU machine, or pip install \".[gpu]\" (onnxruntime-gpu, without "
                      "onnxruntime) on a machine with an NVIDIA GPU") from error

import os
import zlib

from runtime.batching.block_table import BlockConfig
from runtime.model.device import providers, run_device
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError, Manifest, draft_mismatch, read_manifest
from runtime.model.model_runner import ModelRunner
from runtime.model.ort_session import use_process_pool
from runtime.model.runner import Runner
from runtime.request.params import SamplingParams
from runtime.batching.executor import Completion, Executor, RequestHandle
from runtime.request.sequence import Sequence
from runtime.speculation.speculator import Speculation, SpecState
from runtime.request.validate import RequestError, check_ids, check_params, check_prompt_type, check_prompts, check_text
from runtime.request.validate import prompt_byte_limit


def _runner(engine_dir: Path, manifest: Manifest, spec: KVCacheSpec, threads: int | None, providers_: list[str],
            **options) -> Runner:
    """The engine's runner: a ModelRunner (`options`: spinning, device, kv_backend, graph_decode), or for a
    tensor-parallel engine the rank-0 runner that starts the other ranks (runtime.parallel.runner)."""
    if manifest.tensor_parallel is not None:
        from runtime.parallel.runner import TensorParallelRunner

        return TensorParallelRunner(engine_dir, manifest, spec, threads, providers_, options.get("device"),
                                    options.get("kv_backend"))
    return ModelRunner(engine_dir, manifest, spec, threads, providers_, **options)


def _host_room() -> int:
    """Half the host memory available now: the default KV budget's ceiling on CPU."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 2**62


class LLM:
    """A loaded engine.

    `max_batch_size` / `max_seq_len` default to the engine's built limits; smaller values or, up
    to the model's position limit, larger ones are allowed at load without a rebuild. Generation
    goes through the in-flight batching executor (`executor_options` tune it).

    `process_thread_pool`: run on one ONNX Runtime thread pool for the whole process
    (`runtime.model.ort_session.use_process_pool`): faster for an engine with a draft, whose two sessions take
    turns on the same cores, but from then on every ONNX Runtime session in the process must use that pool,
    so it is for processes that serve engines and nothing else (engine-run and engine-bench:
    `--process-thread-pool`).

    `device`: "cpu" or "cuda" (default: the device the engine was built for). `kv_backend`: "numpy" (the
    CPU default) or "ortvalue" (KV buffers allocated by ONNX Runtime on the device, bound by pointer: the
    CUDA path, which this selects on CPU too). `graph_decode`: decode on fixed buffers per batch bucket, padded,
    at a fixed total length (default: on CUDA when the manifest plans `cuda_graphs`, where each bucket's
    graph is captured on first use; True runs the same path on CPU without capture)."""

    def __init__(self, engine_dir: str | Path, max_batch_size: int | None = None, max_seq_len: int | None = None,
                 threads: int | None = None, check_files: bool = True, draft: str | Path | None = None,
                 process_thread_pool: bool = False, device: str | None = None, kv_backend: str | None = None,
                 graph_decode: bool | None = None, kv_memory_mb: float | None = None, block_size: int = 16,
                 prefix_caching: bool = True, **executor_options):
        self.engine_dir = Path(engine_dir)
        self.manifest = read_manifest(self.engine_dir, check_files)
        self.device = run_device(self.manifest, device)
        self.kv_backend = kv_backend  # None: numpy on CPU, ONNX Runtime OrtValues on CUDA
        self.spec = self._kv_spec(max_batch_size, max_seq_len)
        self.tokenizer = Tokenizer.from_file(str(self.engine_dir / "tokenizer.json"))
        self.max_prompt_bytes = prompt_byte_limit(self.tokenizer, self.spec.max_seq_len)  # runtime/request/validate.py
        self.eos_ids = frozenset(self.manifest.model.tokens.eos_token_ids)
        draft_dir = Path(draft) if draft is not None else self.engine_dir / "draft"
        draft_dir = draft_dir if draft is not None or draft_dir.is_dir() else None
        if process_thread_pool:
            use_process_pool(threads)
        # a target and its draft take turns on the same cores: on sessions of their own neither may spin
        self.runner = _runner(self.engine_dir, self.manifest, self.spec, threads, providers(self.manifest, self.device),
                              spinning=draft_dir is None, device=self.device, kv_backend=kv_backend,
                              graph_decode=graph_decode)
        self.draft_runner = self._load_draft(draft_dir, threads)
        self.blocks = self._blocks(kv_memory_mb, block_size, prefix_caching)
        self.executor_options = executor_options  # max_running, max_tokens_per_step, min_prefix_reuse
        self._executor: Executor | None = None

    def _kv_spec(self, max_batch_size: int | None, max_seq_len: int | None) -> KVCacheSpec:
        built, cap = self.manifest.kv_cache, self.manifest.limits.max_seq_len_cap
        if max_seq_len is not None and not 2 <= max_seq_len <= cap:
            raise EngineError(f"max_seq_len {max_seq_len} is outside 2..{cap} (the model's position limit); "
                              f"the engine was built for {built.max_seq_len}")
        if max_batch_size is not None and max_batch_size < 1:
            raise EngineError(f"max_batch_size must be >= 1, got {max_batch_size}")
        return built.resized(max_batch_size, max_seq_len)

    def _blocks(self, kv_memory_mb: float | None, block_size: int, prefix_caching: bool) -> BlockConfig:
        """The KV budget in blocks (see the class docstring)."""
        if kv_memory_mb is not None and (isinstance(kv_memory_mb, bool) or not kv_memory_mb > 0):
            raise EngineError(f"kv_memory_mb must be a number > 0, got {kv_memory_mb!r}")
        per_token = self.spec.bytes_per_slot // self.spec.max_seq_len
        built = getattr(self.manifest.limits, "kv_memory_budget_mb", None)
        budget = (kv_memory_mb or built) * 2**20 if (kv_memory_mb or built) else min(self.spec.bytes, _host_room() if self.device == "cpu" else self.spec.bytes)
        identity = zlib.crc32(str(self.engine_dir.resolve()).encode())
        try:
            return BlockConfig.for_budget(int(budget), per_token, self.spec.max_seq_len, block_size, prefix_caching,
                                          identity)
        except ValueError as err:
            raise EngineError(str(err)) from None

    def _load_draft(self, path: Path | None, threads: int | None) -> ModelRunner | None:
        """The draft engine: the `draft` argument, else the engine's own `draft/` subdirectory when it
        has one. Its KV cache mirrors the target's slots and length."""
        if path is None:
            return None
        manifest = read_manifest(path)
        if problem := draft_mismatch(self.manifest, manifest):  # runtime/manifest/load.py, as the builder checks
            raise EngineError(f"draft engine {path}: {problem}")
        spec = manifest.kv_cache.resized(self.spec.slots, self.spec.max_seq_len)
        return ModelRunner(path, manifest, spec, threads, providers(manifest, self.device), spinning=False,
                           device=self.device, kv_backend=self.kv_backend)

    @property
    def max_seq_len(self) -> int:
        return self.spec.max_seq_len

    # -- requests -----------------------------------------------------------------------------
    def _request_ids(self, prompt: str | Seq[int]) -> list[int]:
        """A request's prompt: a text too long to fit is refused by its byte length, before tokenizing."""
        if isinstance(prompt, str):
            check_text(prompt, self.max_prompt_bytes)
        return self.encode(prompt)

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        check_prompt_type(prompt)
        ids = list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt).ids
        if not ids:
            raise RequestError("the prompt is empty after tokenization; give at least one token")
        return check_ids(ids, self.manifest.vocab_size)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the checkpoint's chat template (tokenizer_config.json or chat_template.jinja)."""
        from runtime.request.chat import render_chat

        return render_chat(self.engine_dir, messages, add_generation_prompt)

    def _sequences(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> list[Sequence]:
        check_prompts(prompts)
        single = params is None or not isinstance(params, (list, tuple))
        plist = [check_params(params)] * len(prompts) if single else [check_params(p) for p in params]
        if len(plist) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        seqs = [Sequence(self._request_ids(p), sp, self.tokenizer, self.eos_ids) for p, sp in zip(prompts, plist)]
        for i, seq in enumerate(seqs):
            self._check_length(i, seq)
        return seqs

    def _check_length(self, index: int, seq: Sequence) -> None:
        n, new = len(seq.prompt_ids), seq.params.max_new_tokens
        if n >= self.max_seq_len:
            raise RequestError(f"prompt {index} has {n} tokens; this engine serves at most {self.max_seq_len} "
                               f"tokens per sequence (prompt + new tokens)")
        if n + new > self.max_seq_len:
            raise RequestError(f"prompt {index}: {n} prompt tokens + max_new_tokens {new} = {n + new} exceeds "
                               f"max_seq_len {self.max_seq_len}; use max_new_tokens <= {self.max_seq_len - n} "
                               f"or load the engine with a larger max_seq_len")

    # -- generation ---------------------------------------------------------------------------
    @property
    def executor(self) -> Executor:
        """The in-flight batching executor serving this engine (started on first use)."""
        if self._executor is None:
            self._executor = self.new_executor(**self.executor_options)
        return self._executor

    def new_executor(self, **options) -> Executor:
        """A fresh executor over this engine's runners (`options`: max_running, max_tokens_per_step,
        min_prefix_reuse); the caller shuts it down. Two executors must not run on one engine at once."""
        return Executor(self.runner, self.draft_runner, blocks=self.blocks, **options)

    def make_sequence(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                      speculation: Speculation | None = None) -> Sequence:
        """Validate one request; raises RequestError before any work if it cannot be served."""
        seq = Sequence(self._request_ids(prompt), check_params(params), self.tokenizer, self.eos_ids)
        self._check_length(0, seq)
        if speculation is not None:
            if speculation.method == "draft" and self.draft_runner is None:
                raise RequestError("speculation method 'draft' needs a draft engine; this engine has none "
                                   "(build one with a `speculative:` recipe section, or load with draft=DIR)")
            seq.spec = SpecState(speculation)
        return seq

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 speculation: Speculation | None = None) -> list[Completion]:
        """Complete every prompt (text or token ids). All requests are validated before any work."""
        seqs = self._sequences(prompts, params)
        for seq in seqs if speculation is not None else ():
            seq.spec = SpecState(speculation)
        handles = [self.executor.submit_sequence(s) for s in seqs]
        return [h.result() for h in handles]

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None,
               speculation: Speculation | None = None) -> Iterator[str]:
        """Yield text deltas for one prompt as tokens are generated."""
        handle = self.executor.submit_sequence(self.make_sequence(prompt, params, speculation))
        try:
            yield from handle.text_stream()
        finally:
            if handle.finish_reason is None:
                handle.cancel()

    def submit(self, prompt: str | Seq[int], params: SamplingParams | None = None,
               speculation: Speculation | None = None) -> RequestHandle:
        """Queue one request on the executor; returns a handle that streams, cancels and ends with a
        result. `speculation` turns on speculative decoding for this request only."""
        return self.executor.submit_sequence(self.make_sequence(prompt, params, speculation))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        getattr(self.runner, "close", lambda: None)()  # a tensor-parallel runner stops its workers
