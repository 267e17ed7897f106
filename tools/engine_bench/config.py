"""BenchConfig: what engine-bench runs. The click options are derived from the dataclass fields."""
from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import numpy as np

from runtime.cli import option_spec
from runtime.config import ExecutorConfig, LoadConfig
from tools.bench.measure import int_list

WORKLOADS = ("fixed", "stream", "concurrency", "prefix", "speculative", "kv")
MODES = ("in-flight", "static", "single-stream", "transformers")  # transformers needs --checkpoint
SPECULATION_METHODS = ("ngram", "draft", "eagle")  # runtime.speculation.speculator.Speculation.method
SPEC_PROMPTS = ("copy", "code", "chat")  # tools.engine_bench.workloads.text_prompts


@dataclass(frozen=True)
class LengthDist:
    """A seeded token-length distribution: `uniform:LOW:HIGH` (inclusive) or `fixed:N` (or just `N`)."""

    kind: str
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "fixed") or not 1 <= self.low <= self.high:
            raise ValueError(f"bad length distribution {self}: use uniform:LOW:HIGH with 1 <= LOW <= HIGH, or N")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = str(text).split(":")
        try:
            if parts[0] == "uniform" and len(parts) == 3:
                return cls("uniform", int(parts[1]), int(parts[2]))
            n = int(parts[-1]) if parts[0] == "fixed" and len(parts) == 2 else int(text)
            return cls("fixed", n, n)
        except ValueError:
            raise ValueError(f"bad length distribution {text!r}: use uniform:LOW:HIGH or N") from None

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(self.low, self.high + 1, n)]

    def __str__(self) -> str:
        return f"{self.low}" if self.kind == "fixed" else f"uniform:{self.low}:{self.high}"


class _Parsed(click.ParamType):
    """A click type from a parse function; values already parsed pass through."""

    def __init__(self, name: str, parse, passthrough: type):
        self.name, self._parse, self._passthrough = name, parse, passthrough

    def convert(self, value, param, ctx):
        if isinstance(value, self._passthrough):
            return value
        try:
            return self._parse(value)
        except ValueError as err:
            self.fail(str(err), param, ctx)


def _names(allowed: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        names = [w.strip() for w in str(text).split(",") if w.strip()]
        if names == ["all"]:
            return allowed
        bad = [w for w in names if w not in allowed]
        if bad or not names:
            raise ValueError(f"unknown {what} {bad or text!r}: choose from {', '.join(allowed)} or all")
        return tuple(names)
    return parse


INT_LIST = _Parsed("INTS", int_list, tuple)
LENGTHS = _Parsed("DIST", LengthDist.parse, LengthDist)
WORKLOAD_LIST = _Parsed("WORKLOADS", _names(WORKLOADS, "workload"), tuple)
METHOD_LIST = _Parsed("METHODS", _names(SPECULATION_METHODS, "speculation method"), tuple)
PROMPT_LIST = _Parsed("PROMPTS", _names(SPEC_PROMPTS, "prompt kind"), tuple)
MODE_LIST = _Parsed("MODES", _names(MODES, "mode"), tuple)


def opt(default: Any, help: str, type: Any = None, **click_kwargs) -> Any:
    return field(default=default, metadata={"help": help, "type": type, **click_kwargs})


def inherited(config: type, name: str, help: str | None = None) -> Any:
    """A field that is the runtime's `config` field of the same name (LoadConfig, ExecutorConfig): its default,
    click type and help (unless given) come from there (runtime.cli.option_spec)."""
    _, spec = option_spec(config, name)
    extra = {"is_flag": True} if spec.get("is_flag") else {}
    return opt(spec["default"], help or spec["help"], spec.get("type", bool), **extra)


@dataclass(frozen=True)
class BenchConfig:
    """Everything one engine-bench invocation measures and where it writes."""

    engine: Path = opt(None, "Engine directory written by engine-build.", click.Path(exists=True, file_okay=False,
                                                                                       path_type=Path),
                       required=True)
    checkpoint: Path | None = opt(None, "HF checkpoint the engine was built from: adds transformers generate "
                                        "as a baseline.", click.Path(exists=True, file_okay=False, path_type=Path))
    workload: tuple[str, ...] = opt(WORKLOADS[:-1], f"Comma list of {', '.join(WORKLOADS)}, or all (default: all but "
                                                    f"kv, whose default lengths need a 2048+-token engine).",
                                    WORKLOAD_LIST)
    modes: tuple[str, ...] = opt(MODES, f"Comma list of {', '.join(MODES)}, or all (prefix always compares "
                                        f"in-flight with reuse on and off).", MODE_LIST)
    batch: tuple[int, ...] = opt((1, 4, 16), "fixed: batch sizes (requests arriving together).", INT_LIST)
    input_len: int = opt(128, "fixed: prompt tokens per request.")
    output_len: int = opt(64, "fixed: generated tokens per request.")
    num_requests: int = opt(64, "stream: number of requests.")
    rate: float = opt(4.0, "stream: mean arrival rate (requests/s, exponential inter-arrival times).")
    input_len_dist: LengthDist = opt(LengthDist.parse("uniform:32:512"), "stream/concurrency: prompt lengths.",
                                     LENGTHS)
    output_len_dist: LengthDist = opt(LengthDist.parse("uniform:16:128"), "stream/concurrency: output lengths.",
                                      LENGTHS)
    concurrency: tuple[int, ...] = opt((1, 2, 4, 8, 16), "concurrency: closed-loop client counts.", INT_LIST)
    requests_per_client: int = opt(3, "concurrency: requests each client sends per level.")
    min_sweep_requests: int = opt(12, "concurrency: at least this many requests per level.")
    prefix_len: int = opt(512, "prefix: shared system-prompt tokens.")
    suffix_len_dist: LengthDist = opt(LengthDist.parse("uniform:8:32"), "prefix: distinct suffix lengths.", LENGTHS)
    prefix_requests: int = opt(16, "prefix: requests sharing the system prompt (sent one after another).")
    prefix_output_len: int = opt(16, "prefix: generated tokens per request.")
    kv_rows: int = opt(8, "kv: the KV budget, in max_seq_len rows (what the old slot policy ran at once).")
    kv_clients: int = opt(64, "kv: closed-loop clients of the mixed-length trace (load with --max-batch-size >= this).")
    kv_requests: int = opt(128, "kv: requests of the mixed-length trace and of the no-shared-prefix pair.")
    kv_prompt_len_dist: LengthDist = opt(LengthDist.parse("uniform:16:1024"), "kv: mixed-length prompt lengths.",
                                         LENGTHS)
    kv_output_len_dist: LengthDist = opt(LengthDist.parse("uniform:16:512"), "kv: mixed-length output lengths.",
                                         LENGTHS)
    kv_prefix_len: int = opt(2048, "kv: shared system-prompt tokens (cache on / off).")
    kv_prefix_clients: int = opt(32, "kv: staggered clients sharing the system prompt.")
    kv_stagger_s: float = opt(0.25, "kv: seconds between the shared-prefix clients' arrivals.")
    speculate: tuple[str, ...] = opt(SPECULATION_METHODS, "speculative: methods compared with no speculation in the "
                                                          "same run (ngram = prompt lookup; draft = the draft "
                                                          "engine).", METHOD_LIST)
    draft: Path | None = inherited(LoadConfig, "draft", "speculative: draft engine directory (default: the engine's "
                                                        "own draft/, e.g. from a `speculative:` recipe; a quantized "
                                                        "build of the same checkpoint is self-drafting).")
    spec_prompts: tuple[str, ...] = opt(SPEC_PROMPTS[:2], "speculative: prompt kinds, from held-out Python stdlib files: "
                                                      "copy (a passage, then its first lines again: continuing "
                                                      "copies from the prompt) and code (continue a file); chat: "
                                                      "the held-out chat questions of issue 49 in the engine's chat "
                                                      "template (tools/compress/eagle_prompts_eval.txt).",
                                        PROMPT_LIST)
    spec_requests: int = opt(6, "speculative: requests per prompt kind (one held-out file each).")
    spec_prompt_len: int = opt(256, "speculative: prompt tokens per request (>= 64).")
    spec_output_len: int = opt(128, "speculative: generated tokens per request.")
    spec_concurrency: tuple[int, ...] = opt((1, 4), "speculative: closed-loop client counts.", INT_LIST)
    num_draft: int = opt(4, "speculative: initial draft length (adapts to acceptance, up to max(8, this)).")
    max_batch_size: int | None = inherited(LoadConfig, "max_batch_size")
    max_seq_len: int | None = inherited(LoadConfig, "max_seq_len")
    kv_memory_mb: float | None = inherited(LoadConfig, "kv_memory_mb")
    block_size: int | None = inherited(LoadConfig, "block_size")
    max_tokens_per_step: int = inherited(ExecutorConfig, "max_tokens_per_step")
    compaction: bool = inherited(ExecutorConfig, "compaction", "in-flight: move decoding sequences down into empty KV "
                                 "rows (SlotTable.compact); --compaction off measures what it buys.")
    max_running: int | None = inherited(ExecutorConfig, "max_running", "in-flight: rows the executor decodes together "
                                        "(default: every KV slot); more clients than this wait in its queue. Fewer "
                                        "rows make each step, and so TPOT, shorter where a step is compute-bound.")
    threads: int | None = inherited(LoadConfig, "threads", "ONNX Runtime / torch intra-op threads (default: all "
                                                           "cores).")
    process_thread_pool: bool = inherited(LoadConfig, "process_thread_pool")
    runs: int = opt(1, "Repeat every measurement; report the median.")
    seed: int = opt(0, "Seed for lengths, arrivals and prompt token ids.")
    out: Path = opt(Path("bench_results/engine-bench"), "Results folder (JSON, markdown, PNG plots).",
                    click.Path(file_okay=False, path_type=Path))
    write_docs: Path | None = opt(None, "Markdown file whose '## engine-bench: <workloads> on `<engine>`' section "
                                        "is written or replaced.", click.Path(dir_okay=False, path_type=Path))

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "num_requests", "requests_per_client", "min_sweep_requests",
                     "prefix_len", "prefix_requests", "prefix_output_len", "runs", "spec_requests", "spec_output_len",
                     "num_draft", "kv_rows", "kv_clients", "kv_requests", "kv_prefix_len", "kv_prefix_clients"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        self.load_config()  # the runtime's configs check their own fields
        self.executor_config()
        if self.rate <= 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if self.spec_prompt_len < 64:
            raise ValueError(f"--spec-prompt-len must be >= 64, got {self.spec_prompt_len}")

    def load_config(self) -> LoadConfig:
        """How engine-bench loads the engine: this config's LoadConfig fields."""
        return LoadConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LoadConfig)
                             if hasattr(self, f.name)})

    def executor_config(self) -> ExecutorConfig:
        return ExecutorConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ExecutorConfig)
                                 if hasattr(self, f.name)})

    def command_line(self) -> str:
        """The engine-bench command that reproduces this config (options that differ from defaults)."""
        words = ["engine-bench"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("is_flag") and value:
                words.append("--" + f.name.replace("_", "-"))
            elif f.metadata.get("required") or value != f.default:
                shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
                words += ["--" + f.name.replace("_", "-"), shown]
        return shlex.join(words)

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(value: Any) -> Any:
    if isinstance(value, (Path, LengthDist)):
        return str(value)
    return list(value) if isinstance(value, tuple) else value


def config_options(command):
    """One click option per BenchConfig field (help, type and default from the field)."""
    for f in reversed(dataclasses.fields(BenchConfig)):
        meta = dict(f.metadata)
        kind = meta.pop("type") or type(f.default)
        default = None if meta.get("required") else f.default
        command = click.option("--" + f.name.replace("_", "-"), f.name, type=kind, default=default,
                               show_default=default is not None, **meta)(command)
    return command
