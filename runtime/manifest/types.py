"""The typed manifest: frozen dataclasses for every section of manifest.json, read from and written to its
JSON form by the same field list, so the builder (which writes it) and the runtime (which reads it) cannot
drift. A missing field or a value of the wrong type is an EngineError naming the field."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from runtime.manifest import typed_json
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.typed_json import INVALID, MISSING, MISTYPED, NOT_OBJECT, FieldError

FORMAT_VERSION = 1
OMIT_NONE = {"omit_none": True}  # field metadata: a None value is left out of the JSON (an absent section)


class EngineError(ValueError):
    """The engine directory is missing, tampered with, truncated or incompatible."""


def _fail(where: str, problem: str) -> EngineError:
    return EngineError(f"manifest.json: {where} {problem}; the manifest is damaged or was edited, rebuild the engine")


def _name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def from_json(cls: type, data: Any, where: str) -> Any:
    """An instance of the dataclass `cls` from its JSON object `data`, read by the typed-JSON reader
    (runtime/manifest/typed_json.py; keys it does not know are ignored: a newer builder's additions);
    `where` names the section in errors, which are EngineErrors naming the field."""
    try:
        return typed_json.read(cls, data, where)
    except FieldError as err:
        at = f"{err.where}.{err.key}".lstrip(".") if err.kind == MISSING else err.where
        problem = {NOT_OBJECT: f"is {_name(err.value)}, expected an object", MISSING: "is missing",
                   MISTYPED: f"is {_name(err.value)} {err.value!r:.60}, expected {err.expected}",
                   INVALID: f"is invalid ({err.cause})"}[err.kind]
        raise _fail(at, problem) from None


def to_json(value: Any) -> Any:
    """The JSON form of a manifest dataclass (or anything inside one): tuples become lists."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value):
        return _fields_json(value)
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def _fields_json(value: Any) -> dict:
    """A dataclass's fields in JSON form, in field order; an OMIT_NONE field that is None is left out."""
    return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)
            if not (f.metadata.get("omit_none") and getattr(value, f.name) is None)}


@dataclass(frozen=True)
class Tokens:
    """Special token ids from generation_config.json / config.json."""

    bos_token_id: int | None
    pad_token_id: int | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ModelInfo:
    """What the engine was built from. `hyperparameters` is the traced HF config subset (a mapping)."""

    family: str
    architecture: str
    source: str
    config_sha256: str
    hyperparameters: dict[str, Any]
    num_parameters: int
    tokens: Tokens

    def __post_init__(self) -> None:
        vocab = self.hyperparameters.get("vocab_size")
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
            raise _fail("model.hyperparameters.vocab_size", f"is {vocab!r}, expected a positive int")
        limit = self.hyperparameters.get("max_position_embeddings")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
            raise _fail("model.hyperparameters.max_position_embeddings", f"is {limit!r}, expected an int or null")

    @property
    def vocab_size(self) -> int:
        return self.hyperparameters["vocab_size"]

    @property
    def max_position_embeddings(self) -> int | None:
        return self.hyperparameters.get("max_position_embeddings")


BACKENDS = ("onnxruntime", "tensorrt")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
ATTENTION = ("gqa", "paged")  # GroupQueryAttention over slot rows, or PagedAttention over a block pool (CUDA)
WEIGHT_KERNELS = ("auto", "ort", "fpa_intb")  # CUDA weight-only matmul kernels (runtime/model/weight_kernels.py)


def one_of(section: str, key: str, value: Any, allowed: tuple) -> None:
    """A section's check: `value` is one of `allowed` (a ValueError naming the field and the choices)."""
    if value not in allowed:
        raise ValueError(f"{section}.{key}: {value!r} is not allowed; allowed: {list(allowed)}")


def at_least(section: str, key: str, value: Any, low: float) -> None:
    if value is not None and value < low:
        raise ValueError(f"{section}.{key}: must be >= {low}, got {value}")


@dataclass(frozen=True)
class Target:
    """What an engine is built for: the recipe's `target:` section (builder/recipe.py reads it from YAML)
    and the first fields of the manifest's (BuiltTarget). ONNX Runtime on CPU in float32 by default.
    `attention`: gqa (GroupQueryAttention, a max_seq_len KV row per sequence) or paged (PagedAttention over
    a pool of KV blocks, packed variable-length batches; CUDA only). `weight_kernels`: which CUDA kernels run the
    quantized matmuls, ONNX Runtime's own ("ort") or TensorRT-LLM's CUTLASS weight-only ones ("fpa_intb"); "auto"
    picks the measured one (runtime/model/weight_kernels.py); a load may override it."""

    backend: str = "onnxruntime"
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "gqa"
    weight_kernels: str = "auto"

    def __post_init__(self) -> None:
        one_of("target", "backend", self.backend, BACKENDS)
        one_of("target", "weight_kernels", self.weight_kernels, WEIGHT_KERNELS)
        one_of("target", "device", self.device, DEVICES)
        one_of("target", "dtype", self.dtype, DTYPES)
        one_of("target", "attention", self.attention, ATTENTION)
        if self.device == "cpu" and self.dtype == "bfloat16":
            raise ValueError("target.dtype: bfloat16 needs device cuda; on cpu use float32 or float16")
        if self.attention == "paged" and (self.device != "cuda" or self.dtype == "float32"):
            raise ValueError(f"target.attention: paged (ONNX Runtime's PagedAttention) runs only on CUDA in float16 or "
                             f"bfloat16, not {self.device} {self.dtype}; use attention gqa, or device cuda with "
                             f"dtype float16")


@dataclass(frozen=True, kw_only=True)
class BuiltTarget(Target):
    """The manifest's target: what the engine was built for, and with which opset, contrib ops and packages."""

    onnx_opset: int
    contrib_ops: tuple[str, ...]
    built_with: dict[str, str]  # package -> version the engine was built with (onnx, onnxruntime)


@dataclass(frozen=True)
class Limits:
    """The batch and length an engine is planned for: the recipe's `limits:` section (`kv_memory_budget_mb`
    fits the KV slots into a memory budget) and the first fields of the manifest's (BuiltLimits). A load
    may ask for smaller values, or longer sequences up to the model's position limit, without a rebuild."""

    max_batch_size: int = 8
    max_seq_len: int = 2048
    kv_memory_budget_mb: float | None = None

    def __post_init__(self) -> None:
        at_least("limits", "max_batch_size", self.max_batch_size, 1)
        at_least("limits", "max_seq_len", self.max_seq_len, 2)
        at_least("limits", "kv_memory_budget_mb", self.kv_memory_budget_mb, 0)


@dataclass(frozen=True, kw_only=True)
class BuiltLimits(Limits):
    """The manifest's limits: the batch (KV slots) and length built, and the longest a load may ask for."""

    max_seq_len_cap: int  # the model's position limit: a load may ask for up to this length


@dataclass(frozen=True)
class Rope:
    """Rotary tables' inputs: cos/sin = outer(positions, inv_freq) * attention_scaling."""

    type: str  # a transformers rope type, or "none" (learned positions: one zero frequency)
    inv_freq: tuple[float, ...]
    attention_scaling: float
    interleaved: bool
    exact_up_to: int | None = field(default=None, metadata=OMIT_NONE)  # longrope: exact below this length


@dataclass(frozen=True)
class IO:
    """The graph's inputs and outputs: name -> {"dtype", "shape"} (symbolic axes are strings)."""

    inputs: dict[str, dict[str, Any]]
    outputs: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class QuantizationRecord:
    """The manifest's `quantization`: `mode` ("none", "int8", "int4_rtn", ...) and the builder's record of the
    scheme and the weights (what builder/recipe.py's Quantization options produced)."""

    mode: str = "none"
    record: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_section(cls, data: Any, where: str) -> QuantizationRecord:
        """The section's `mode`, checked; every other key is the record, kept as written."""
        if not isinstance(data, dict):
            raise _fail(where, f"is {_name(data)}, expected an object")
        if not isinstance(data.get("mode"), str):
            raise _fail(f"{where}.mode", "is missing" if "mode" not in data else f"is {_name(data['mode'])}, expected str")
        return cls(data["mode"], {k: v for k, v in data.items() if k != "mode"})

    def to_dict(self) -> dict:
        return {"mode": self.mode, **self.record}

    @property
    def accuracy_level(self) -> int:
        """MatMulNBits accuracy_level (>= 2 quantizes activations on the fly); 0 for a float engine."""
        return self.record.get("accuracy_level", 0)


@dataclass(frozen=True)
class SamplingHead:
    """The builder's ArgMax/TopK outputs after the logits (builder/passes/append_sampling_head.py)."""

    max_top_k: int


@dataclass(frozen=True)
class CudaGraphs:
    """The decode batch buckets planned for CUDA-graph replay (builder/passes/plan_cuda_graphs.py)."""

    enabled: bool = False
    batch_sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class PassTiming:
    """One pipeline pass as it ran in the build."""

    phase: str
    name: str
    seconds: float
    disabled: bool


@dataclass(frozen=True)
class Speculative:
    """The draft engine built into `<engine>/<draft_dir>`: a draft model (`kind` "model") or an EAGLE draft head
    ("eagle", runtime/speculation/eagle.py)."""

    draft_dir: str
    draft_model: str
    draft_quantization: str
    num_draft_tokens: int
    kind: str = "model"


@dataclass(frozen=True)
class SegmentFile:
    """One lowered segment of a rank (builder/segments.py): its ONNX file, the layers whose KV it reads and
    writes, and its interface as `IO`'s (name -> {"dtype", "shape"})."""

    file: str
    layers: tuple[int, ...]
    inputs: dict[str, dict[str, Any]]
    outputs: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Collective:
    """A sum over the ranks of `input` (written by segment `after_segment`) into `output` (the same buffer)."""

    after_segment: int
    input: str
    output: str
    op: str = "all_reduce"


@dataclass(frozen=True)
class TensorParallelRank:
    """One rank's ONNX segments, in order."""

    rank: int
    segments: tuple[SegmentFile, ...]


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel engine's ranks and the all-reduces between their segments (builder/build.py)."""

    size: int
    ranks: tuple[TensorParallelRank, ...]
    collectives: tuple[Collective, ...]  # the all-reduce after each segment but the last
    replicated: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageRank:
    """One process of a pipeline stage: its tensor-parallel rank within the stage (`tp_rank`, 0 without tensor
    parallelism), its process rank (`rank`: 1 + stage * tensor_parallel + tp_rank; rank 0 schedules) and its ONNX
    segments in order (one without tensor parallelism; with it, those between the stage's all-reduces)."""

    tp_rank: int
    rank: int
    segments: tuple[SegmentFile, ...]


@dataclass(frozen=True)
class PipelineStage:
    """One stage of a pipeline-parallel engine (builder/pipeline_stages.py): layers [first, stop) and what else
    it holds (`holds`: embedding on the first, final norm, lm_head and sampling head on the last; with tensor
    parallelism the embedding on each of the first stage's ranks, the part after the last all-reduce on the last
    stage's tp rank 0 only), its processes (`ranks`: one, or one per tensor-parallel rank, each with segments
    whose KV inputs are its own layers' and, sharded, its own heads'), the all-reduces between those segments
    (`collectives`, none without tensor parallelism), the boundary values it `receives` from the stage before
    and `sends` to the next (name -> {"dtype", "shape"}; the hidden states, the same on every tp rank), and
    its weight bytes (all its ranks')."""

    stage: int
    layers: tuple[int, int]
    holds: tuple[str, ...]
    ranks: tuple[StageRank, ...]
    receives: dict[str, dict[str, Any]]
    sends: dict[str, dict[str, Any]]
    weight_bytes: int
    collectives: tuple[Collective, ...] = ()


def _one_segment_stages(data: Any) -> Any:
    """A manifest built before pipeline x tensor parallelism gives each stage one `segment` in place of `ranks`:
    read it as the stage's one process (rank stage + 1), so those engines keep loading."""
    section = data.get("pipeline_parallel") if isinstance(data, dict) else None
    stages = section.get("stages") if isinstance(section, dict) else None
    if not isinstance(stages, list) or not any(isinstance(s, dict) and "segment" in s for s in stages):
        return data
    stages = [{**{k: v for k, v in s.items() if k != "segment"},
               "ranks": [{"tp_rank": 0, "rank": s.get("stage", i) + 1, "segments": [s["segment"]]}]}
              if isinstance(s, dict) and "segment" in s and "ranks" not in s else s for i, s in enumerate(stages)]
    return {**data, "pipeline_parallel": {**section, "stages": stages}}


@dataclass(frozen=True)
class PipelineParallel:
    """A pipeline-parallel engine's stages in order, each of `tensor_parallel` processes: stage s's tp rank t
    runs as process rank 1 + s * tensor_parallel + t (rank 0 schedules)."""

    size: int
    stages: tuple[PipelineStage, ...]
    tensor_parallel: int = 1

    @property
    def world(self) -> int:
        """Every process: rank 0 and each stage's ranks."""
        return 1 + self.size * self.tensor_parallel

    def place(self, rank: int) -> tuple[int, int]:
        """(stage, tp rank) of process rank `rank` >= 1."""
        return divmod(rank - 1, self.tensor_parallel)


@dataclass(frozen=True)
class LoraLinear:
    """One linear with adapter inputs: `a` [slots, in, rank] and `b` [slots, rank, out] graph inputs; `modules`
    the family module names it holds (several for a fused projection: its A side by side along the rank,
    `max_rank` each, and its B block-diagonal, each module's output columns `widths` in order)."""

    layer: int
    a: str
    b: str
    modules: tuple[str, ...]
    widths: tuple[int, ...]
    in_features: int


@dataclass(frozen=True)
class Lora:
    """Multi-LoRA inputs (builder/passes/add_lora.py): `max_adapters` slots after slot 0 (the base, zeros),
    adapters of rank up to `max_rank` on the `targets` modules; `ids` the int64 [batch, seq] input of
    each token's slot."""

    max_rank: int
    max_adapters: int
    targets: tuple[str, ...]
    ids: str = "lora_ids"
    linears: tuple[LoraLinear, ...] = ()


@dataclass(frozen=True)
class FileEntry:
    """A file of the engine directory as the build left it."""

    sha256: str
    bytes: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """manifest.json as typed sections. `Manifest.from_dict(json)` reads and checks it; `to_dict()` is the
    JSON the builder writes (format_version 1). `manifest["section"]` gives a section's JSON form, for
    scripts written against the file; code in this package reads the typed fields."""

    format_version: int = FORMAT_VERSION
    builder_version: str | None = field(default=None, metadata=OMIT_NONE)
    created: str | None = field(default=None, metadata=OMIT_NONE)
    model: ModelInfo
    recipe: dict[str, Any] | None = field(default=None, metadata=OMIT_NONE)
    target: BuiltTarget
    limits: BuiltLimits
    kv_cache: KVCacheSpec
    rope: Rope
    quantization: QuantizationRecord = QuantizationRecord()
    io: IO
    sampling_head: SamplingHead | None = field(default=None, metadata=OMIT_NONE)
    cuda_graphs: CudaGraphs = CudaGraphs()
    passes: tuple[PassTiming, ...] | None = field(default=None, metadata=OMIT_NONE)
    build_seconds: float | None = field(default=None, metadata=OMIT_NONE)
    speculative: Speculative | None = field(default=None, metadata=OMIT_NONE)
    tensor_parallel: TensorParallel | None = field(default=None, metadata=OMIT_NONE)
    pipeline_parallel: PipelineParallel | None = field(default=None, metadata=OMIT_NONE)
    lora: Lora | None = field(default=None, metadata=OMIT_NONE)
    files: dict[str, FileEntry] = field(default_factory=dict)
    verification: dict[str, Any] | None = field(default=None, metadata=OMIT_NONE)  # the build-time check's report

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise _fail("format_version", f"is {self.format_version}, this runtime reads version {FORMAT_VERSION}")

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        return from_json(cls, _one_segment_stages(data), "")

    def to_dict(self) -> dict:
        return _fields_json(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def replace(self, **changes) -> Manifest:
        return dataclasses.replace(self, **changes)

    def __getitem__(self, section: str) -> Any:
        return self.to_dict()[section]

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size
