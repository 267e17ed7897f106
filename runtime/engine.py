"""The embeddable Python API: load an engine directory, generate for a batch of prompts, stream
text for one prompt. An engine step is schedule -> run -> postprocess."""
from __future__ import annotations

import dataclasses
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

from runtime.manifest.arith import ceil_div
from runtime.batching.block_table import BlockConfig
from runtime.config import ExecutorConfig, LoadConfig, split_options
from runtime.model.device import run_device
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError, Manifest, draft_mismatch, read_manifest
from runtime.model.model_runner import ModelRunner
from runtime.model.ort_session import use_process_pool
from runtime.model.runner import Runner
from runtime.parallel.launch import Launch, refuse, serve_stage
from runtime.request.params import SamplingParams
from runtime.batching.executor import Completion, Executor, RequestHandle
from runtime.request.sequence import Sequence
from runtime.speculation.eagle import EagleRunner, is_head
from runtime.speculation.speculator import Speculation, SpecState, draft_kind, draft_problem
from runtime.request.validate import RequestError, check_ids, check_params, check_prompt_type, check_prompts, check_text
from runtime.request.validate import TOO_LONG, prompt_byte_limit


def _runner(engine_dir: Path, manifest: Manifest, spec: KVCacheSpec, config: LoadConfig, blocks: BlockConfig,
            spinning: bool) -> Runner:
    """The engine's runner: a ModelRunner, for a paged engine a PagedModelRunner over a pool of the budget's
    `blocks`, or for a tensor-parallel engine the rank-0 runner that starts the other ranks
    (runtime.parallel.runner). `config.device` is the resolved device."""
    if spec.block_size is not None:
        from runtime.model.paged_runner import PagedModelRunner

        return PagedModelRunner(engine_dir, manifest, spec, config, blocks.num_blocks, spinning)
    if manifest.pipeline_parallel is None and (launch := Launch.from_env()) is not None:
        raise refuse(launch, f"{engine_dir} is not a pipeline-parallel engine, and torchrun started {launch.world} "
                             f"processes for it: run it without torchrun (a tensor-parallel engine starts its own "
                             f"ranks)")
    if manifest.pipeline_parallel is not None:
        from runtime.parallel.pipeline_runner import PipelineRunner

        return PipelineRunner(engine_dir, manifest, spec, config)
    if manifest.tensor_parallel is not None:
        from runtime.parallel.runner import TensorParallelRunner

        return TensorParallelRunner(engine_dir, manifest, spec, config)
    return ModelRunner(engine_dir, manifest, spec, config, spinning)


def _host_room() -> int:
    """Half the host memory available now: the default KV budget's ceiling on CPU."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 2**62


class LLM:
    """A loaded engine.

    `load` (runtime/config.py `LoadConfig`: limits, threads, draft, device, KV backend, graph decode) says
    how it is loaded and `executor` (`ExecutorConfig`) how its in-flight batching executor runs; any of
    their fields may be given as keyword arguments instead, e.g. `LLM(dir, max_batch_size=4,
    max_tokens_per_step=64)`.

    `process_thread_pool` runs on one ONNX Runtime thread pool for the whole process
    (`runtime.model.ort_session.use_process_pool`): faster for an engine with a draft, whose two sessions take
    turns on the same cores, but from then on every ONNX Runtime session in the process must use that pool,
    so it is for processes that serve engines and nothing else (engine-run and engine-bench:
    `--process-thread-pool`)."""

    def __init__(self, engine_dir: str | Path, load: LoadConfig | None = None, executor: ExecutorConfig | None = None,
                 adapters: dict[str, str | Path] | None = None, **options):
        """`adapters`: LoRA adapters to load at once, name -> PEFT directory (an engine built with `lora:`).
        Under torchrun (a pipeline-parallel engine across processes or machines) rank 0 loads the engine; on
        any other rank this serves its pipeline stage and exits the process when rank 0 stops the engine."""
        if (launch := Launch.from_env()) is not None and launch.rank > 0:
            serve_stage(engine_dir, launch)  # runtime/parallel/launch.py; never returns
        load, self.executor_config = split_options(options, load, executor)  # runtime/config.py
        self.engine_dir = Path(engine_dir)
        self.manifest = read_manifest(self.engine_dir, load.check_files)
        # the device resolved once: every runner (draft and tensor-parallel ranks too) loads with this config
        self.config = dataclasses.replace(load, device=run_device(self.manifest, load.device))
        self.device = self.config.device
        self.executor_config.steps_ahead(self.device)  # a lookahead without overlap is refused at load
        self.kv_backend = load.kv_backend  # None: numpy on CPU, ONNX Runtime OrtValues on CUDA
        self.spec = self._kv_spec(load.max_batch_size, load.max_seq_len)
        self.tokenizer = Tokenizer.from_file(str(self.engine_dir / "tokenizer.json"))
        self.max_prompt_bytes = prompt_byte_limit(self.tokenizer, self.spec.max_seq_len)  # runtime/request/validate.py
        self.eos_ids = frozenset(self.manifest.model.tokens.eos_token_ids)
        draft_dir = load.draft if load.draft is not None else self.engine_dir / "draft"
        draft_dir = draft_dir if load.draft is not None or draft_dir.is_dir() else None
        if draft_dir is not None and self.manifest.pipeline_parallel is not None:
            raise EngineError(f"a draft engine ({draft_dir}) is not supported with a pipeline-parallel engine yet; "
                              f"load it without draft (n-gram speculation needs none)")
        if load.process_thread_pool:
            use_process_pool(load.threads)
        # a target and its draft take turns on the same cores: on sessions of their own neither may spin
        self.blocks = self._blocks(load)
        self.runner = _runner(self.engine_dir, self.manifest, self.spec, self.config, self.blocks,
                              spinning=draft_dir is None)
        self.draft_runner = self._load_draft(draft_dir)
        for runner in (self.runner, self.draft_runner):  # no request pays a prompt bucket's first run
            if runner is not None:
                runner.warm_prompt_shapes(self.executor_config.max_tokens_per_step)
        self._executor: Executor | None = None
        self._closed = False
        for name, path in (adapters or {}).items():
            self.load_adapter(name, path)

    def _kv_spec(self, max_batch_size: int | None, max_seq_len: int | None) -> KVCacheSpec:
        built, cap = self.manifest.kv_cache, self.manifest.limits.max_seq_len_cap
        if max_seq_len is not None and not 2 <= max_seq_len <= cap:
            raise EngineError(f"max_seq_len {max_seq_len} is outside 2..{cap} (the model's position limit); "
                              f"the engine was built for {built.max_seq_len}")
        return built.resized(max_batch_size, max_seq_len)

    def _blocks(self, load: LoadConfig) -> BlockConfig:
        """The KV memory budget in blocks: `kv_memory_mb`, else the engine's built budget, else every row's
        max_seq_len (on CPU at most half the host memory available). A paged engine's blocks are the device
        pool's, of the block size its graph was built with."""
        per_token, paged = self.spec.bytes_per_token, self.spec.block_size
        if paged and load.block_size not in (None, paged):
            raise EngineError(f"block_size {load.block_size}: this paged engine's blocks are {paged} tokens, fixed "
                              f"in its graph; leave block_size unset (or rebuild with kv_cache.block_size)")
        size = paged or load.block_size or 16
        mb = load.kv_memory_mb or getattr(self.manifest.limits, "kv_memory_budget_mb", None)
        # every row's max_seq_len, whole blocks (a row shorter than a block still takes one)
        rows = self.spec.slots * ceil_div(self.spec.max_seq_len, size) * size * per_token
        room = _host_room() if self.device == "cpu" else rows
        budget = mb * 2**20 if mb else min(rows, room)
        identity = zlib.crc32(str(self.engine_dir.resolve()).encode())  # never matches another engine's blocks
        try:
            return BlockConfig.for_budget(int(budget), per_token, self.spec.max_seq_len, size,
                                          load.prefix_caching, identity)
        except ValueError as err:
            raise EngineError(str(err)) from None

    def _load_draft(self, path: Path | None) -> ModelRunner | None:
        """The draft engine: the `draft` option, else the engine's own `draft/` subdirectory when it
        has one. Its KV cache mirrors the target's slots and length."""
        if path is None:
            return None
        if is_head(path):  # an EAGLE head (runtime/speculation/eagle.py)
            return self._load_head(path)
        manifest = read_manifest(path)
        if problem := draft_mismatch(self.manifest, manifest):  # runtime/manifest/load.py, as the builder checks
            raise EngineError(f"draft engine {path}: {problem}")
        spec = manifest.kv_cache.resized(self.spec.slots, self.spec.max_seq_len)
        return ModelRunner(path, manifest, spec, self.config, spinning=False)

    def _load_head(self, path: Path) -> EagleRunner:
        """The engine's EAGLE head, checked against this target; refused by name where it cannot run."""
        if not getattr(self.runner, "has_hidden", False):
            why = ("a paged engine" if self.spec.block_size is not None else "a tensor-parallel engine"
                   if self.manifest.tensor_parallel is not None else "an engine built without its hidden_states output")
            raise EngineError(f"EAGLE head {path}: {why} cannot feed it (the head needs the target's last hidden state "
                              f"from a one-session, slot-KV engine built with `speculative: {{draft_model: HEAD}}`)")
        return EagleRunner(path, self.manifest, self.engine_dir, self.spec, self.config.threads, self.runner.cache.device)

    @property
    def max_seq_len(self) -> int:
        return self.spec.max_seq_len

    # -- requests -----------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        """A request's prompt as validated token ids (every surface's one path: RequestError naming the problem);
        a text too long to fit is refused by its byte length, before tokenizing."""
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

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None) -> list[int]:
        """The chat's prompt token ids, validated: the template's markup may hold control tokens, the messages'
        content never does (special-token text in content is tokenized as plain text, runtime/request/chat.py);
        no BOS/EOS is added beyond what the template writes, as transformers' apply_chat_template(tokenize=True).
        `tools`: OpenAI function tools, for a template that renders them (runtime/request/tools.py)."""
        from runtime.request.chat import GuardedChat

        chat = GuardedChat(self.engine_dir, self.tokenizer, messages, add_generation_prompt, tools)
        check_text(chat.text, self.max_prompt_bytes)
        ids = chat.ids()
        if not ids:
            raise RequestError("the chat is empty after tokenization; give at least one message with content")
        return check_ids(ids, self.manifest.vocab_size)

    def _sequences(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> list[Sequence]:
        check_prompts(prompts)
        single = params is None or not isinstance(params, (list, tuple))
        plist = [check_params(params)] * len(prompts) if single else [check_params(p) for p in params]
        if len(plist) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        seqs = [Sequence(self.prompt_ids(p), sp, self.tokenizer, self.eos_ids) for p, sp in zip(prompts, plist)]
        for i, seq in enumerate(seqs):
            self._check_length(i, seq)
            self._check_adapter(seq)
        return seqs

    def _check_length(self, index: int | None, seq: Sequence) -> None:
        n, new = len(seq.prompt_ids), seq.params.max_new_tokens
        which = "the prompt" if index is None else f"prompt {index}"
        if n >= self.max_seq_len:
            raise RequestError(f"{which} has {n} tokens; this engine serves at most {self.max_seq_len} "
                               f"tokens per sequence (prompt + new tokens)", code=TOO_LONG)
        if n + new > self.max_seq_len:
            raise RequestError(f"{which}: {n} prompt tokens + max_new_tokens {new} = {n + new} exceeds "
                               f"max_seq_len {self.max_seq_len}; use max_new_tokens <= {self.max_seq_len - n} "
                               f"or load the engine with a larger max_seq_len", field="max_new_tokens", code=TOO_LONG)

    def _check_scoring(self, seq: Sequence, speculation: Speculation | None) -> None:
        """Log-probabilities and a grammar's mask need the full logits of each token's own step: not a speculative
        verify, and prompt logprobs not a paged engine's packed call (which returns each row's last logits only).
        A structured-output constraint is compiled here (its Guide), before any work."""
        if seq.params.full_logits and speculation is not None:
            raise RequestError("logprobs, prompt_logprobs and structured outputs cannot be combined with speculation; "
                               "run without it", field="speculation")
        if seq.params.structured is not None:
            from runtime.request.structured import Guide

            try:
                seq.guide = Guide(seq.params.structured, self.tokenizer, self.manifest.vocab_size, self.eos_ids)
            except ValueError as err:
                raise RequestError(str(err), field="structured") from None
            except ImportError:
                raise RequestError("structured outputs need the llguidance package: pip install "
                                   "'llm-engine-builder[serve]' (or llguidance)", field="structured") from None
        if seq.params.prompt_logprobs is not None and not self.runner.scores_prompts:
            raise RequestError("prompt_logprobs are not available on a paged engine yet (its packed call returns "
                               "each row's last logits only); use an engine built without target.attention paged",
                               field="prompt_logprobs")

    # -- generation ---------------------------------------------------------------------------
    @property
    def executor(self) -> Executor:
        """The in-flight batching executor serving this engine (started on first use)."""
        if self._executor is None:
            self._executor = self.new_executor()
        return self._executor

    @property
    def closed(self) -> bool:
        return self._closed

    def new_executor(self, blocks: BlockConfig | None = None, **changes) -> Executor:
        """A fresh executor over this engine's runners, with this engine's ExecutorConfig and `changes` to its
        fields (max_running, max_tokens_per_step, ...) and its KV blocks (or `blocks`: another budget or
        prefix caching); the caller shuts it down. Two executors must not run on one engine at once."""
        if self._closed:
            raise RuntimeError(f"this LLM ({self.engine_dir}) is closed: load the engine again to generate")
        config = dataclasses.replace(self.executor_config, **changes)
        if self.manifest.pipeline_parallel is not None:  # one executor per stage: micro-batches in flight
            from runtime.parallel.virtual_engines import VirtualEngines

            return VirtualEngines(self.runner, self.runner.micro_batches, config, blocks or self.blocks)
        return Executor(self.runner, self.draft_runner, config, blocks or self.blocks)

    def make_sequence(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                      speculation: Speculation | None = None) -> Sequence:
        """Validate one request; raises RequestError before any work if it cannot be served."""
        seq = Sequence(self.prompt_ids(prompt), check_params(params), self.tokenizer, self.eos_ids)
        self._check_length(None, seq)
        self._check_scoring(seq, speculation)
        self._check_adapter(seq)
        if speculation is not None:
            if problem := draft_problem(speculation.method, draft_kind(self.draft_runner)):
                raise RequestError(problem, field="speculation")
            seq.speculation = SpecState(speculation)
        return seq

    # -- LoRA adapters (runtime/lora/pool.py) --------------------------------------------------
    @property
    def adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters requests may use (SamplingParams.adapter)."""
        return self.runner.lora.names if self.runner.lora is not None else []

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load the PEFT LoRA adapter at `path` as `name`; a refused adapter raises AdapterError naming the
        field, and changes nothing."""
        self._lora_pool("load_adapter").load(name, path)

    def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        """Unload adapter `name`: new requests on it are refused at once, those running finish first."""
        self._lora_pool("unload_adapter").unload(name, timeout)

    def _lora_pool(self, what: str):
        if self.runner.lora is None:
            raise ValueError(f"{what}: this engine was built without LoRA inputs; build it with a recipe section "
                             f"lora: {{max_rank: 16, max_adapters: 4}}")
        return self.runner.lora

    def _check_adapter(self, seq: Sequence) -> None:
        """Refuse a request on an adapter that is not loaded, naming the loaded ones."""
        if seq.params.adapter is None:
            return
        if self.runner.lora is None:
            raise RequestError(f"adapter {seq.params.adapter!r}: this engine was built without LoRA inputs "
                               f"(no adapters loaded)", field="adapter")
        try:
            self.runner.lora.slot_of(seq.params.adapter)
        except ValueError as err:
            raise RequestError(str(err), field="adapter") from None

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 speculation: Speculation | None = None) -> list[Completion]:
        """Complete every prompt (text or token ids). All requests are validated before any work."""
        seqs = self._sequences(prompts, params)
        for seq in seqs:
            self._check_scoring(seq, speculation)
        if speculation is not None and (problem := draft_problem(speculation.method, draft_kind(self.draft_runner))):
            raise RequestError(problem, field="speculation")
        for seq in seqs if speculation is not None else ():
            seq.speculation = SpecState(speculation)
        return [h.result() for h in self.executor.submit_sequences(seqs)]

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
        """Stop the executor (its requests end "cancelled") and the runners; the LLM serves nothing afterwards."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        getattr(self.runner, "close", lambda: None)()  # a tensor- or pipeline-parallel runner stops its workers


    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
