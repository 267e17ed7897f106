"""Build recipes: YAML validated into typed dataclasses. The schema is the dataclass fields; unknown
or mistyped keys are errors naming the key and the allowed ones; `--set a.b=value` overrides any field."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from builder.quant.levels import check_activation_block, check_setting as check_accuracy_levels
from builder.quant.schemes import INT4_BLOCK, SCHEMES
# `target:` and `limits:` are the engine-format contract's own types (the manifest's target and limits
# extend them), checked there; the other sections are the builder's options
from runtime.manifest import typed_json
from runtime.manifest.typed_json import INVALID, MISSING, MISTYPED, NOT_OBJECT, UNKNOWN, FieldError
from runtime.manifest.types import Limits, SamplingHead, Target, at_least, one_of

QUANT_MODES = ("none", *SCHEMES)  # the scheme registry's names (builder/quant/schemes.py), or no quantization

class RecipeError(ValueError):
    """The recipe has an unknown key, a value of the wrong type or an out-of-range value."""


@dataclass
class Passes:
    """Optional fusions; a disabled one stays in the pipeline as a visible no-op."""

    fuse_qkv: bool = True
    fuse_gate_up: bool = True
    fuse_add_rmsnorm: bool = True


@dataclass
class Quantization:
    """Weight-only quantization to MatMulNBits: `mode` none or a scheme of builder/quant/schemes.py
    (int8 | int4_rtn | int4_awq | int4_gptq | int8_gptq). `group_size` is the block along K, 16/32/64/128, default 32
    (llama.cpp q4_0's and q8_0's; builder/quant/schemes.py INT4_BLOCK and INT8_BLOCK say why);
    `exclude` holds fnmatch patterns over IR weight names ("lm_head", "layers.*.qkv");
    `accuracy_level` None is the target's default (cpu 4, cuda 0), a level, or levels per layer kind
    (`{default: 4, lm_head: 1}`, builder/quant/levels.py), or `auto`: per matmul, the fastest kernel of this
    CPU's measured table within `accuracy_budget` (perplexity on the calibration text at most that fraction above
    the same weights in float, measured at build where the float reference runs; builder/kernel_choice.py) and,
    when set, `accuracy_top1_budget` (top-1 agreement with float on the same windows at least 1 minus it) and
    `accuracy_kl_budget` (the mean KL divergence of the engine's next-token distribution from float's, nats a token,
    as llama.cpp's `--kl-divergence` reports it), moving groups of matmuls to blocks of 16 for their int8
    activations or to float activations;
    `activation_block`: the MatMulNBits block matmuls with int8 activations run at, one or per layer kind
    (`{qkv: 16, lm_head: 16}`): a weight stored in larger blocks it divides is re-blocked exactly
    (builder/quant/levels.py); with `accuracy_level: auto`, where the kernel choice starts from, or `auto` itself
    (measured by that choice; with explicit levels, blocks as stored):
    the build re-blocks at 16 each layer kind whose re-block removes a larger share of the int8 rounding's KL
    divergence from float than the share of matmul time it adds (the most worth first, and with
    `accuracy_kl_budget` only until it holds; builder/kernel_choice.py);
    `calibration` is a text file for int4_awq's scale search and GPTQ's Hessians (default
    builder/data/calibration.txt), or `self`: text the model writes itself (builder/quant/calibration.py
    self_written_sequences); `damp` (GPTQ)
    is added to the Hessian diagonal as a fraction of its mean, and `act_order` (GPTQ, on by default) quantizes
    columns by descending Hessian diagonal with static contiguous groups (SmolLM2-135M int4: +5.8% perplexity
    against +15.0% in column order, docs/ACCURACY.md; the same kernel either way). `lm_head`: the output projection
    is quantized like the other linears (`same`), at 8 bits (`int8`), kept float (`none`, or an `exclude`
    pattern naming it), or `auto` (the default): at 8 bits under a 4-bit scheme, else like the others (a 4-bit
    head cost SmolLM2-135M +33% perplexity against +24% at 8 bits; llama.cpp's q4_0 keeps a Q8_0 or Q6_K
    output: docs/ACCURACY.md); a tied embedding quantized with it is
    stored once and read by row (GatherBlockQuantized). The pattern "lm_head" matches it tied or not."""

    mode: str = "none"
    group_size: int = INT4_BLOCK
    symmetric: bool = True
    exclude: list[str] = field(default_factory=list)
    accuracy_level: int | str | dict[str, int] | None = None
    calibration: str | None = None
    lm_head: str = "auto"
    damp: float = 0.01
    act_order: bool = True
    accuracy_budget: float = 0.01
    accuracy_top1_budget: float | None = None
    accuracy_kl_budget: float | None = None
    activation_block: int | str | dict[str, int] | None = None

    def __post_init__(self) -> None:
        one_of("quantization", "mode", self.mode, QUANT_MODES)
        if not 0 < self.damp < 1:
            raise RecipeError(f"quantization.damp: {self.damp} is not in (0, 1) (a fraction of the mean Hessian diagonal)")
        one_of("quantization", "lm_head", self.lm_head, ("auto", "same", "int8", "none"))
        one_of("quantization", "group_size", self.group_size, (16, 32, 64, 128))
        if not 0 <= self.accuracy_budget < 1:
            raise RecipeError(f"quantization.accuracy_budget: {self.accuracy_budget} is not in [0, 1) (a fraction of "
                              f"the float perplexity, 0.01 = within 1%)")
        if self.accuracy_top1_budget is not None and not 0 <= self.accuracy_top1_budget < 1:
            raise RecipeError(f"quantization.accuracy_top1_budget: {self.accuracy_top1_budget} is not in [0, 1) (how "
                              f"far top-1 agreement with float may fall below 1, 0.03 = at least 0.97) or null")
        if self.accuracy_kl_budget is not None and not 0 <= self.accuracy_kl_budget < 1:
            raise RecipeError(f"quantization.accuracy_kl_budget: {self.accuracy_kl_budget} is not in [0, 1) (the mean "
                              f"KL divergence from float allowed, nats a token, e.g. 0.003) or null")
        try:
            check_accuracy_levels(self.accuracy_level)
            check_activation_block(self.activation_block)
        except ValueError as err:
            raise RecipeError(str(err)) from None


@dataclass
class Parallel:
    """`tensor_parallel` ranks split every layer (docs/PARALLEL.md); `pipeline_parallel` stages split the model
    by layers, contiguous ranges balanced by weight bytes or given as `pipeline_layers` (layers per stage, in
    order: [16, 16]). Whether the ranges fit the model is checked at build, against its layer count."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_layers: list[int] | None = None

    def __post_init__(self) -> None:
        at_least("parallel", "tensor_parallel", self.tensor_parallel, 1)
        at_least("parallel", "pipeline_parallel", self.pipeline_parallel, 1)
        if self.pipeline_layers is not None:
            if len(self.pipeline_layers) != self.pipeline_parallel:
                raise RecipeError(f"parallel.pipeline_layers {self.pipeline_layers} gives {len(self.pipeline_layers)} "
                                  f"stages, pipeline_parallel is {self.pipeline_parallel}: give one layer count per stage")
            if any(n < 1 for n in self.pipeline_layers):
                raise RecipeError(f"parallel.pipeline_layers {self.pipeline_layers} leaves a stage empty; every stage "
                                  f"holds at least one layer")


@dataclass
class Verify:
    """Compare the built engine with the transformers reference. `auto`: on for models up to
    `auto_max_params` parameters.

    A quantized engine is compared with transformers running the engine's own dequantized weights
    (max |logit error| <= `tolerance`, or, where MatMulNBits quantizes activations, accuracy_level
    >= 2, <= `quantized_tolerance` x the largest reference logit; a GGUF file's engine: the median position's
    logit error relative to the reference's spread <= `quantized_tolerance`, builder/reference_check.py) and
    with the float model, whose
    greedy picks it must match at >= `min_greedy_agreement` of the positions. 0.5 passes the
    quantization noise of random-weight test checkpoints (int4 flips up to ~40% of their near-flat
    argmaxes) and fails a broken engine (~1/vocab); raise it for trained models."""

    enabled: str | bool = "auto"
    tolerance: float = 1e-3
    num_sequences: int = 3
    seq_len: int = 24
    auto_max_params: int = 600_000_000
    quantized_tolerance: float = 0.1
    min_greedy_agreement: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.enabled, bool):
            self.enabled = "on" if self.enabled else "off"
        one_of("verify", "enabled", self.enabled, ("auto", "on", "off"))
        at_least("verify", "tolerance", self.tolerance, 0)
        at_least("verify", "num_sequences", self.num_sequences, 1)
        at_least("verify", "seq_len", self.seq_len, 2)
        at_least("verify", "quantized_tolerance", self.quantized_tolerance, 0)
        if not 0 <= self.min_greedy_agreement <= 1:
            raise RecipeError(f"verify.min_greedy_agreement: must be in [0, 1], got {self.min_greedy_agreement}")


@dataclass
class SpeculativeOptions:
    """A draft engine built next to the target (into `<out>/draft`) for speculative decoding:
    `draft_model` names a smaller checkpoint with the same tokenizer; `self_draft` instead builds this
    checkpoint again with that quantization mode (an int4 build drafting for its float32 / int8 build).
    `draft_quantization` quantizes a `draft_model` (default none: a float32 draft)."""

    draft_model: str | None = None
    self_draft: str | None = None
    num_draft_tokens: int = 4
    draft_quantization: str | None = None

    def __post_init__(self) -> None:
        if self.draft_model is not None and self.self_draft is not None:
            raise RecipeError("speculative: give draft_model or self_draft, not both")
        if self.self_draft is not None:
            one_of("speculative", "self_draft", self.self_draft, tuple(SCHEMES))
        if self.draft_quantization is not None:
            if self.draft_model is None:
                raise RecipeError("speculative: draft_quantization quantizes a draft_model; give draft_model too "
                                  "(a self_draft is its own quantization mode)")
            one_of("speculative", "draft_quantization", self.draft_quantization, tuple(SCHEMES))
        at_least("speculative", "num_draft_tokens", self.num_draft_tokens, 1)

    @property
    def enabled(self) -> bool:
        return self.draft_model is not None or self.self_draft is not None

    @property
    def eagle(self) -> bool:
        """Whether draft_model is an EAGLE draft head (engine-compress --eagle) rather than a model."""
        from pathlib import Path

        return self.draft_model is not None and (Path(self.draft_model) / "eagle.json").is_file()


@dataclass(frozen=True)
class SamplingHeadOptions(SamplingHead):
    """The manifest's SamplingHead as asked for: ArgMax and TopK appended to the engine graph (outputs
    `next_token`, `topk_values`, `topk_indices`) so the runtime reads token ids or k candidates instead of
    [batch, vocab] logits; `logits` stays an output. k is min(max_top_k, vocab); `enabled` false leaves
    the head out. Default k 32: ONNX Runtime's CUDA TopK has its single-pass kernel only for k <= 32, and on
    CPU TopK costs the same for k 1..64 (~0.1 ms per row of a 128k vocabulary, measured with
    tools/bench/topk_cost.py); sampling with top_k above k reads the full logits instead."""

    max_top_k: int = 32
    enabled: bool = True

    def __post_init__(self) -> None:
        at_least("sampling_head", "max_top_k", self.max_top_k, 1)


@dataclass
class CudaGraphsOptions:
    """The candidate decode batch buckets the CUDA runtime captures one graph each for, from which
    PlanCudaGraphs plans the manifest's CudaGraphs. `enabled` None means on when target.device is cuda;
    the buckets are clipped to the planned batch limit (which is added)."""

    enabled: bool | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])

    def __post_init__(self) -> None:
        if not self.batch_sizes:
            raise RecipeError("cuda_graphs.batch_sizes: give at least one batch size, e.g. [1, 2, 4, 8]")
        for size in self.batch_sizes:
            at_least("cuda_graphs", "batch_sizes", size, 1)


@dataclass
class KVCacheOptions:
    """How the KV cache stores keys and values: `dtype` float (the target dtype) or int8 (codes with static
    per-channel scales, calibrated on `calibration` text, default builder/data/calibration.txt: half the
    bytes of float16, a quarter of float32). `block_size`: tokens per KV block of a paged engine
    (`target.attention: paged`), fixed in its graph."""

    dtype: str = "float"
    calibration: str | None = None
    block_size: int = 16

    def __post_init__(self) -> None:
        one_of("kv_cache", "dtype", self.dtype, ("float", "int8"))
        at_least("kv_cache", "block_size", self.block_size, 1)


@dataclass
class LoraOptions:
    """Multi-LoRA serving (builder/passes/add_lora.py): each linear named in `targets` (the family's module
    names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj for Llama) gets `y += (x @ A[id]) @ B[id]`
    per token, A and B stacked graph inputs of `max_adapters` + 1 slots (slot 0: zeros, the base model) and rank
    `max_rank`. `max_adapters` 0 (the default) builds no LoRA inputs; a `lora:` section must name it (load_recipe
    refuses `lora: {}`, which would build nothing)."""

    max_rank: int = 16
    max_adapters: int = 0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])

    def __post_init__(self) -> None:
        at_least("lora", "max_rank", self.max_rank, 1)
        at_least("lora", "max_adapters", self.max_adapters, 0)
        if self.max_adapters and not self.targets:
            raise RecipeError("lora.targets is empty; name at least one linear module (e.g. q_proj)")

    @property
    def enabled(self) -> bool:
        return self.max_adapters > 0


@dataclass
class GGUFOptions:
    """Options of a build from a GGUF file (builder/gguf/). `requantize`: `none` (the default) carries every
    tensor exactly; the i-quants and ternary types (IQ4_XS, IQ2_XXS, TQ1_0, ...) then run as 8-bit MatMulNBits,
    8 bits a weight plus a scale per block, more bytes than the file (builder/gguf/repack.py). `int4` instead
    dequantizes those tensors and rounds them to int4 (round to nearest, symmetric, blocks of 32: int4_rtn's
    path), 4-bit bytes at a measured loss (docs/BUILD.md, "GGUF files"); the file's other types stay exact."""

    requantize: str = "none"

    def __post_init__(self) -> None:
        one_of("gguf", "requantize", self.requantize, ("none", "int4"))


@dataclass
class Recipe:
    """A whole build: which checkpoint, for which target, with which limits and passes."""

    model: str
    out: str | None = None
    target: Target = field(default_factory=Target)
    limits: Limits = field(default_factory=Limits)
    passes: Passes = field(default_factory=Passes)
    quantization: Quantization = field(default_factory=Quantization)
    parallel: Parallel = field(default_factory=Parallel)
    verify: Verify = field(default_factory=Verify)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    sampling_head: SamplingHeadOptions = field(default_factory=SamplingHeadOptions)
    cuda_graphs: CudaGraphsOptions = field(default_factory=CudaGraphsOptions)
    kv_cache: KVCacheOptions = field(default_factory=KVCacheOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    gguf: GGUFOptions = field(default_factory=GGUFOptions)

    def __post_init__(self) -> None:
        if self.lora.enabled:
            self._check_lora()
        if self.kv_cache.dtype != "float" and self.parallel.tensor_parallel > 1:
            raise RecipeError("kv_cache.dtype int8 is not supported with parallel.tensor_parallel > 1 yet; "
                              "use kv_cache.dtype float")
        if self.target.attention == "paged" and self.parallel.tensor_parallel > 1:
            raise RecipeError("target.attention paged is not supported with parallel.tensor_parallel > 1 yet; "
                              "use target.attention gqa")
        if self.parallel.pipeline_parallel > 1:
            self._check_pipeline()
        if self.cuda_graphs.enabled is None:  # a pipeline stage decodes eagerly
            self.cuda_graphs.enabled = self.target.device == "cuda" and self.parallel.pipeline_parallel == 1

    def _check_pipeline(self) -> None:
        """What a pipeline-parallel engine does not build yet, refused by name (docs/PARALLEL.md)."""
        refused = {"target.attention paged": self.target.attention == "paged",
                   "speculative (a draft engine)": self.speculative.enabled,
                   "cuda_graphs.enabled": bool(self.cuda_graphs.enabled)}
        for what, asked in refused.items():
            if asked:
                raise RecipeError(f"{what} is not supported with parallel.pipeline_parallel > 1 yet; build without "
                                  f"it or with pipeline_parallel 1")

    def _check_lora(self) -> None:
        """LoRA is built for what the runtime feeds it on: one float32 graph (or its pipeline stages) over contiguous
        KV rows."""
        if self.parallel.tensor_parallel > 1:
            shape = (f"a pipeline_parallel {self.parallel.pipeline_parallel} x tensor_parallel "
                     f"{self.parallel.tensor_parallel} engine" if self.parallel.pipeline_parallel > 1
                     else "parallel.tensor_parallel > 1")
            raise RecipeError(f"lora is not supported with {shape} yet (the adapters' A and B are not sharded); "
                              f"use parallel.tensor_parallel 1 (pipeline_parallel alone serves LoRA) or "
                              f"lora.max_adapters 0")
        if self.target.attention == "paged":
            raise RecipeError("lora is not supported with target.attention paged yet (adapter ids are fed per "
                              "contiguous KV row); use target.attention gqa or lora.max_adapters 0")
        if self.target.dtype != "float32":
            raise RecipeError(f"lora needs target.dtype float32 (the adapters' A and B are float32 inputs), "
                              f"not {self.target.dtype}")
        if self.cuda_graphs.enabled:
            raise RecipeError("lora is not supported with cuda_graphs.enabled (the adapters' rows are picked per "
                              "call, a shape a captured graph cannot change); use cuda_graphs.enabled false")
        self.cuda_graphs.enabled = False  # the default on cuda, off with lora

    def draft_recipe(self) -> Recipe:
        """The recipe of the draft engine: same target and limits, its own checkpoint or quantization."""
        spec = self.speculative
        data = self.to_dict() | {"speculative": {}, "out": None, "lora": {}}
        if spec.draft_model is not None:
            data |= {"model": spec.draft_model, "quantization": {"mode": spec.draft_quantization or "none"},
                     "gguf": {}}
        else:
            data["quantization"] = dict(data["quantization"], mode=spec.self_draft)
        return from_dict(Recipe, data, "recipe.speculative")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_recipe(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None) -> Recipe:
    """Read a YAML recipe (or start from `base`), apply `key.sub=value` overrides, validate."""
    data: dict[str, Any] = copy.deepcopy(base or {})
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise RecipeError(f"{path}: not UTF-8 text (byte {err.start}); save the recipe as UTF-8") from None
        except yaml.YAMLError as err:
            raise RecipeError(f"{path}: not valid YAML: {err}") from err
        if not isinstance(loaded, dict):
            raise RecipeError(f"{path}: a recipe is a YAML mapping, got {type(loaded).__name__}")
        data.update(loaded)
    for item in overrides:
        _apply_override(data, item)
    lora = data.get("lora")
    if isinstance(lora, dict) and "max_adapters" not in lora:
        raise RecipeError(f"lora: {lora!r} names no max_adapters, so it would build no LoRA inputs; give "
                          f"lora.max_adapters (the adapters served at once, >= 1; 0 builds none) or drop the section")
    return from_dict(Recipe, data, "recipe")


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise RecipeError(f"--set {item!r}: expected key=value, e.g. limits.max_seq_len=512")
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"--set {item!r}: {part!r} is not a section")
    try:
        node[leaf] = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise RecipeError(f"--set {item!r}: the value is not valid YAML: {err}") from err


def from_dict(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a mapping with the typed-JSON reader (runtime/manifest/typed_json.py),
    strictly: an unknown key is an error naming the allowed ones; YAML 1.1's numeric strings are floats."""
    try:
        return typed_json.read(cls, data, where, strict=True, numeric_strings=True)
    except FieldError as err:
        raise RecipeError(_message(err)) from err.cause


def _message(err: FieldError) -> str:
    got = f"{type(err.value).__name__} {err.value!r}"
    return f"{err.where}: " + {
        NOT_OBJECT: f"expected a mapping of {getattr(err.expected, '__name__', err.expected)} fields, "
                    f"got {err.value!r}",
        UNKNOWN: f"unknown key {err.key!r}; allowed: {list(err.allowed)}",
        MISSING: f"missing required key {err.key!r}",
        MISTYPED: f"expected {err.expected}, got {got}",
        INVALID: str(err.cause)}[err.kind]
