"""How an engine is loaded (`LoadConfig`) and how its in-flight batching executor runs (`ExecutorConfig`):
two frozen configs, validated when made, passed whole to the runners, the tensor-parallel ranks (as JSON to a
worker process) and the executor. The CLIs derive their flags from these fields (runtime/cli.py).

Light on purpose (no ONNX Runtime import): a CLI builds its options from it before the heavy imports."""
from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path

from runtime.manifest.types import DEVICES, WEIGHT_KERNELS, EngineError

KV_BACKENDS = ("numpy", "ortvalue")
# ExecutorConfig.lookahead with overlap: a chain's end costs a postprocess and a schedule in series with the device
# (~150 us on the CPU measured in docs/BENCHMARKS.md, "Steps run ahead"), spread over this many steps; each row
# holds blocks for this many tokens ahead (one more block at block size 16)
LOOKAHEAD = 16


def option_field(default, help: str, **click) -> dataclasses.Field:
    """A config field with the help text its CLI flag shows and hints for it (`choices`, `directory`,
    `minimum`: the least integer allowed, and `unset`: what None means where it is allowed; `_check`
    enforces both)."""
    return field(default=default, metadata={"help": help, **click})


def _check(config, error: type[Exception]) -> None:
    """Each field with a `minimum` is an integer at least that, or None where it has an `unset` meaning."""
    for f in dataclasses.fields(config):
        value, least, unset = getattr(config, f.name), f.metadata.get("minimum"), f.metadata.get("unset")
        if least is None or (value is None and unset):
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
            none = f" (or None: {unset})" if unset else ""
            raise error(f"{f.name} must be an integer >= {least}{none}, got {value!r}")


@dataclass(frozen=True)
class LoadConfig:
    """How to load an engine directory.

    `max_batch_size` / `max_seq_len` default to the engine's built limits; smaller values or, up to the
    model's position limit, larger ones are allowed at load without a rebuild. `process_thread_pool`: one
    ONNX Runtime thread pool for the whole process (`runtime.model.ort_session.use_process_pool`). `device`:
    default the one the engine was built for. `kv_backend`: "numpy" (the CPU default) or "ortvalue" (KV
    buffers allocated by ONNX Runtime on the device: the CUDA path, which this selects on CPU too).
    `graph_decode`: decode on fixed buffers per batch bucket (default: on CUDA when the manifest plans
    `cuda_graphs`; True runs the same path on CPU without capture). `kv_memory_mb`: the KV memory budget,
    charged by blocks of `block_size` tokens as sequences grow (runtime/batching/block_table.py; default: the
    engine's built budget, else every row's max_seq_len), so `max_batch_size` rows may be resident at once
    however many max_seq_len rows the budget holds. `prefix_caching`: keep full blocks and reuse them by hash.
    `prompt_buckets`: prompt chunks (and verify calls) run padded to a few lengths, warmed at load.
    `micro_batches`: a pipeline-parallel engine's groups of sequences in flight (runtime/parallel/virtual_engines.py).
    `weight_kernels`: the CUDA kernels of the quantized matmuls (runtime/model/weight_kernels.py)."""

    max_batch_size: int | None = option_field(None, "KV slots to load the engine with (default: the engine's).",
                                         minimum=1, unset="the engine's")
    max_seq_len: int | None = option_field(None, "KV length per sequence (default: the engine's).", minimum=2,
                                      unset="the engine's")
    threads: int | None = option_field(None, "ONNX Runtime intra-op threads.", minimum=1, unset="all cores")
    check_files: bool = option_field(True, "Check every engine file's size and sha256 against the manifest at load.")
    draft: Path | None = option_field(None, "Draft engine directory (default: the engine's own draft/ when it has one).",
                                 directory=True)
    process_thread_pool: bool = option_field(False, "Run the engine and its draft on one ONNX Runtime thread pool for "
                                               "the process (faster with a draft: the two take turns on the same "
                                               "cores).")
    device: str | None = option_field(None, "Where to run (default: the device the engine was built for).",
                                 choices=DEVICES)
    kv_backend: str | None = option_field(None, "KV buffers: numpy arrays (the CPU default) or ONNX Runtime OrtValues "
                                           "on the device (the CUDA path).", choices=KV_BACKENDS)
    graph_decode: bool | None = option_field(None, "Decode on fixed buffers per batch bucket (default: on CUDA when the "
                                              "engine plans CUDA graphs).")

    kv_memory_mb: float | None = option_field(None, "KV memory budget in MB, charged by blocks as sequences grow "
                                                    "(default: the engine's built budget, else every row's "
                                                    "max_seq_len).")
    block_size: int | None = option_field(None, "Tokens per KV block, the unit the KV memory budget is charged in "
                                                "(default 16; a paged engine's is fixed in its graph).", minimum=1,
                                          unset="16, or a paged engine's own")
    prefix_caching: bool = option_field(True, "Keep finished sequences' full KV blocks and reuse them for prompts "
                                              "that start the same.")
    prompt_buckets: bool | None = option_field(
        None, "Run each prompt chunk padded to the next power of two (at least 16 tokens), so a few call shapes "
              "serve every prompt, each run once at load (default: on CUDA, where a call shape's first run costs "
              "tens of milliseconds; off on CPU, where the padding costs compute).")
    micro_batches: int | None = option_field(
        None, "A pipeline-parallel engine's micro-batches in flight, each its own executor over its own KV slots "
              "(default: one per stage; 1: one batch through the stages at a time).", minimum=1,
        unset="one per pipeline stage")
    weight_kernels: str | None = option_field(
        None, "CUDA kernels for the quantized matmuls: ONNX Runtime's own (ort) or TensorRT-LLM's CUTLASS weight-only "
              "ones (fpa_intb); auto: the measured choice (default: the engine's, from its recipe).",
        choices=WEIGHT_KERNELS)

    def __post_init__(self) -> None:
        if self.kv_memory_mb is not None and (isinstance(self.kv_memory_mb, bool)
                                              or not isinstance(self.kv_memory_mb, numbers.Real)
                                              or not self.kv_memory_mb > 0):
            raise EngineError(f"kv_memory_mb must be a number > 0 (or None: the engine's budget), "
                              f"got {self.kv_memory_mb!r}")
        if self.draft is not None and not isinstance(self.draft, Path):
            object.__setattr__(self, "draft", Path(self.draft))
        _check(self, EngineError)  # max_seq_len's upper bound is the engine's position limit: LLM checks it
        if self.kv_backend is not None and self.kv_backend not in KV_BACKENDS:
            raise EngineError(f"kv_backend {self.kv_backend!r} is not one of {KV_BACKENDS}")
        if self.weight_kernels is not None and self.weight_kernels not in WEIGHT_KERNELS:
            raise EngineError(f"weight_kernels {self.weight_kernels!r} is not one of {WEIGHT_KERNELS}")

    def buckets_on(self, device: str) -> bool:
        """Whether prompt chunks run padded to bucket lengths on `device` (default: on CUDA)."""
        return device == "cuda" if self.prompt_buckets is None else self.prompt_buckets

    def to_json(self) -> str:
        """For a tensor-parallel worker process (`from_json` reads it back)."""
        return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> LoadConfig:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class ExecutorConfig:
    """How the in-flight batching executor runs (runtime/batching/executor.py).

    `max_running` rows decode together (default: every KV slot); `max_tokens_per_step` bounds the tokens one
    step computes, so long prompts are prefilled in chunks while others keep decoding; `min_prefix_reuse`:
    the shortest cached prompt prefix worth reusing (prefixes are found in whole KV blocks); `overlap`: the engine
    call runs on a thread of its own while the executor's thread renders the last step's tokens (detokenize, stop
    strings, the callers' events), the same tokens and text either way (runtime/batching/render.py); `lookahead`:
    with overlap, decode steps scheduled at once (multi-step), so the next step's inputs are ready when the
    engine finishes the last one instead of after the executor's postprocess and schedule; `compaction`: decoding
    sequences move down into empty contiguous KV rows (off only to measure what it buys: engine-bench --compaction)."""

    max_running: int | None = option_field(None, "Rows the executor decodes together (default: every KV slot).",
                                      minimum=1, unset="every KV slot")
    max_tokens_per_step: int = option_field(128, "Executor token budget per step (decode rows + prompt chunk).",
                                       minimum=1)
    min_prefix_reuse: int = option_field(8, "The shortest cached prompt prefix worth reusing.", minimum=1)
    overlap: bool | None = option_field(None, "Render a step's text while the next engine call runs (default: on "
                                              "CUDA, off on CPU, where the engine's threads use every core).")
    lookahead: int | None = option_field(
        None, "Decode steps scheduled at once when every row decodes from the sampling head (greedy or top-k) "
              "and no request waits for a row: the engine runs them back to back, each fed the last one's tokens, "
              "while the executor hands out the last one's (needs overlap; default: 16 with overlap, else 1).",
        minimum=1, unset="16 with overlap, else 1")
    compaction: bool = option_field(True, "Move the highest decoding sequence down into an empty KV row below the busy "
                                          "ones, so decode calls over contiguous rows carry fewer idle rows "
                                          "(SlotTable.compact; a paged engine's calls carry none).")

    def __post_init__(self) -> None:
        _check(self, ValueError)
        if self.overlap is False:  # refused here already: without overlap on any device
            self.steps_ahead("cpu")

    def overlaps(self, device: str) -> bool:
        """Whether the engine call runs on a thread of its own on `device` (default: on CUDA)."""
        return device == "cuda" if self.overlap is None else self.overlap

    def steps_ahead(self, device: str) -> int:
        """The lookahead on `device`; a ValueError when it asks for steps ahead without overlap."""
        overlap = self.overlaps(device)
        if self.lookahead is None:
            return LOOKAHEAD if overlap else 1
        if self.lookahead > 1 and not overlap:
            off = "it is off" if self.overlap is False else f"which is off on {device} by default"
            raise ValueError(f"lookahead {self.lookahead} needs overlap (the engine runs the steps on a thread of its "
                             f"own while the executor hands out tokens), {off}: set overlap=True, or lookahead=1")
        return self.lookahead


def split_options(options: dict, load: LoadConfig | None = None,
                  executor: ExecutorConfig | None = None) -> tuple[LoadConfig, ExecutorConfig]:
    """`load` and `executor` (default: the defaults) with keyword options (as LLM takes them) applied, each
    name to the config that has the field; an unknown name is refused with the names allowed."""
    load_names = {f.name for f in dataclasses.fields(LoadConfig)}
    run_names = {f.name for f in dataclasses.fields(ExecutorConfig)}
    if unknown := sorted(set(options) - load_names - run_names):
        raise TypeError(f"unknown load option(s) {unknown}: LoadConfig takes {sorted(load_names)}, "
                        f"ExecutorConfig {sorted(run_names)}")
    return (dataclasses.replace(load or LoadConfig(), **{k: v for k, v in options.items() if k in load_names}),
            dataclasses.replace(executor or ExecutorConfig(), **{k: v for k, v in options.items() if k in run_names}))
