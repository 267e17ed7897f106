"""A GGUF file as the builder's checkpoint.

`stage_gguf` turns the file into a small checkpoint directory the rest of the builder reads like any other
(config.json from the metadata, the tokenizer files, and gguf_source.json naming the file); the tensors
stay in the GGUF, read through its memory map one at a time by `GGUFCheckpoint`, which presents them under
their Hugging Face names and shapes: block-quantized ones as `GGUFWeight`s whose MatMulNBits arrays are
the file's own integers (builder/gguf/repack.py), float ones as float32. llama.cpp's Q/K row permutation
is undone by reordering rows, which is exact for every type."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from builder.gguf.arch import Arch, arch_of, hf_config, reference_needs_config, tensor_names, unpermute_rows
from builder.gguf.reader import GGUFError, GGUFModel, GGUFTensor, open_gguf
from builder.gguf.repack import (BLOCK_TYPES, DEQUANTIZED_TYPES, FLOAT_TYPES, read_float, repack, symmetric_layout,
                                  unsupported)
from builder.quant.schemes import INT4_BLOCK, QuantizedArrays, dequantize, pack, quantize
from builder.quant.weights import Prequantized
from builder.trace_moe import ExpertLayout
from builder.weights import Checkpoint, CheckpointError, Concat, WeightSource

SOURCE_FILE = "gguf_source.json"
STAGE_VERSION = 3  # bump when what a stage holds changes (reused while the file and this are unchanged)
REQUANTIZE_BITS = {"int4": 4}  # recipe gguf.requantize -> the bits the i-quant tensors are rounded to


def is_gguf_model(path: str | Path) -> bool:
    """A recipe `model:` naming a GGUF file."""
    return str(path).endswith(".gguf")


def is_staged(model_dir: str | Path) -> bool:
    """A checkpoint directory staged from a GGUF file by `stage_gguf`."""
    return (Path(model_dir) / SOURCE_FILE).is_file()


def staged_recipe(recipe, log: Callable[[str], None] = print):
    """`recipe` with each .gguf file it names (`model`, `speculative.draft_model`) replaced by its staged
    directory; as is when it names none."""
    draft, requantize = recipe.speculative.draft_model, recipe.gguf.requantize
    if requantize != "none" and not is_gguf_model(recipe.model) and not is_staged(recipe.model):
        raise GGUFError(f"gguf.requantize {requantize}: model {recipe.model!r} is not a GGUF file; gguf.requantize "
                        f"applies to a .gguf model only (allowed here: none)")
    if is_gguf_model(recipe.model):
        recipe = dataclasses.replace(recipe, model=str(stage_gguf(recipe.model, log, requantize=requantize)))
    if draft is not None and is_gguf_model(draft):
        staged = str(stage_gguf(draft, log, field="speculative.draft_model"))
        recipe = dataclasses.replace(recipe, speculative=dataclasses.replace(recipe.speculative, draft_model=staged))
    return recipe


def as_given(path: str | Path) -> str:
    """What a recipe gave for a checkpoint: the GGUF file a staged directory stands for, else `path`."""
    return str(source_file(path)) if is_staged(path) else str(path)


def stage_gguf(path: str | Path, log: Callable[[str], None] = print, field: str = "model",
               requantize: str = "none") -> Path:
    """The staged checkpoint directory of the GGUF file at `path` (under the user cache; rewritten on each
    call, so it always describes the file as it is now): config.json, tokenizer files, gguf_source.json.
    `field`: the recipe field that names the file, for the error when there is none; `requantize`: the
    recipe's gguf.requantize, which the checkpoint applies to the i-quant tensors (a stage of its own)."""
    from builder.gguf.tokenizer import write_tokenizer_files

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{field} {str(path)!r}: no such GGUF file (a relative path is read from the working "
                        f"directory {os.getcwd()})")
    model = open_gguf(path)
    arch = arch_of(model)
    config = hf_config(model, arch)
    tensor_names(model, arch, layers(config))  # every tensor known before anything is written
    _refuse_types(model)
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    stage = _cache_root() / (f"{path.stem}-{key}" + ("" if requantize == "none" else f"-{requantize}"))
    stat = path.stat()
    source = {"file": str(path.resolve()), "parts": [str(p) for p in model.files], "size": stat.st_size,
              "mtime_ns": stat.st_mtime_ns, "architecture": model.architecture, "stage_version": STAGE_VERSION,
              "requantize": requantize}
    counts = Counter(t.type for t in model.tensors.values())
    for line in carried_lines(counts, requantize):
        log(f"gguf: {path.name}: {line}")
    if is_staged(stage) and json.loads((stage / SOURCE_FILE).read_text()) == source:
        log(f"gguf: {path.name}: staged config and tokenizer reused from {stage}")
        return stage
    tmp = Path(tempfile.mkdtemp(prefix=".staging-", dir=stage.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer_files(model.metadata, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))
        shutil.rmtree(stage, ignore_errors=True)
        tmp.rename(stage)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"gguf: {path.name}: {model.architecture}, {len(model.tensors)} tensors "
        f"({', '.join(f'{n} {t}' for t, n in counts.most_common())}); staged config and tokenizer in {stage}")
    return stage


def _cache_root() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "engine-builder" / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    return root


def carried(type_name: str, requantize: str = "none") -> str:
    """How the engine holds a tensor of an i-quant or ternary type, and at what bytes against the file's."""
    kind = BLOCK_TYPES[type_name]
    if requantize != "none":
        return (f"requantized to int{REQUANTIZE_BITS[requantize]} (round to nearest, blocks of {INT4_BLOCK}; lossy): "
                f"{REQUANTIZE_BITS[requantize]} bits a weight + a float scale per {INT4_BLOCK}, against the file's "
                f"{kind.file_bits():g}")
    return (f"exact as 8-bit MatMulNBits: 8 bits a weight + a float scale per {kind.block}, against the file's "
            f"{kind.file_bits():g} (gguf.requantize: int4 for 4-bit bytes, lossy)")


def carried_lines(counts: Counter, requantize: str) -> list[str]:
    """The build log's word on the i-quant tensors' bytes, one line per such type in the file."""
    widened = [t for t in counts if t in BLOCK_TYPES and BLOCK_TYPES[t].widened]
    if requantize != "none" and not widened:
        return [f"gguf.requantize {requantize}: the file has no i-quant or ternary tensors; nothing requantized"]
    return [f"{counts[t]} {t} tensors {carried(t, requantize)}" for t in widened]


def _refuse_types(model: GGUFModel) -> None:
    for t in model.tensors.values():
        if t.type not in BLOCK_TYPES and t.type not in FLOAT_TYPES and t.type not in DEQUANTIZED_TYPES:
            raise GGUFError(f"{model.path}: {unsupported(t.type, t.name)}")


def source_file(model_dir: str | Path) -> Path:
    """The GGUF file a staged directory stands for."""
    return Path(json.loads((Path(model_dir) / SOURCE_FILE).read_text())["file"])


@dataclass(frozen=True)
class GGUFFormat:
    """What the manifest keeps of a GGUF import: the file and, per tensor, the GGUF type it came from."""

    file: str
    types: dict[str, str]
    staged: str = ""  # the staged directory (config.json, tokenizer files) the build read
    name: str = "gguf"
    requantize: str = "none"  # the recipe's gguf.requantize

    def record(self) -> dict:
        counts = Counter(self.types.values())
        widened = {t: carried(t, self.requantize) for t in counts if t in BLOCK_TYPES and BLOCK_TYPES[t].widened}
        return {"format": self.name, "bits": "per tensor", "file": self.file, "staged": self.staged,
                "type_counts": dict(counts), "tensor_types": dict(self.types),
                **({"carried": widened, "requantize": self.requantize} if widened else {})}


class GGUFCheckpoint(Checkpoint):
    """A staged GGUF checkpoint: tensors under their HF names, read from the file on demand. A mixture of
    experts' stacked tensors [E, out, in] read as they are (`GGUFExperts` for a block type); gate and up,
    two tensors in the file, as HF's one [E, 2I, H] parameter (joined by rows)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.model = open_gguf(source_file(self.path))
        self.arch: Arch = arch_of(self.model)
        self.config = json.loads((self.path / "config.json").read_text())
        self._gguf = tensor_names(self.model, self.arch, layers(self.config))
        self._row_vectors = {t.format(i=i) for t in self.arch.row_vectors for i in range(layers(self.config))}
        _refuse_types(self.model)
        self.requantize = json.loads((self.path / SOURCE_FILE).read_text()).get("requantize", "none")
        types = {hf: "+".join(dict.fromkeys(t.type for t in self._parts(hf))) for hf in self._gguf}
        quantized = any(t.type in BLOCK_TYPES for t in self.model.tensors.values())
        self.format = GGUFFormat(str(self.model.path), types, str(self.path), requantize=self.requantize) \
            if quantized else None

    def names(self) -> set[str]:
        return set(self._gguf)

    def _parts(self, name: str) -> list[GGUFTensor]:
        if name not in self._gguf:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in {self.model.path.name}")
        return [self.model.tensors[g] for g in self._gguf[name]]

    def tensor(self, name: str) -> GGUFTensor:
        """The (first) GGUF tensor holding `name`."""
        return self._parts(name)[0]

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF parameter's shape (GPT-2's Conv1D linears are [in, out]; their sources stay [out, in])."""
        shape = tuple(self.source(name).shape)
        return shape[::-1] if self.stored_out_in(name) else shape

    def stored_out_in(self, name: str) -> bool:
        """A linear weight HF stores [in, out] that the file holds [out, in], read as the file holds it."""
        return self.arch.linears_out_in and name.endswith(".weight") and len(self.tensor(name).shape) == 2 \
            and not any(k in name for k in ("wte", "wpe", "lm_head"))

    def dtype(self, name: str) -> str:
        t = self.tensor(name)
        return t.type if t.type in FLOAT_TYPES else "F32"  # a block type reads as float32

    def describe(self, name: str) -> str:
        return f"{name} (GGUF {', '.join(f'{t.name}, {t.type}' for t in self._parts(name))})"

    def source(self, name: str) -> WeightSource:
        parts = [self._source(name, t) for t in self._parts(name)]
        source = parts[0] if len(parts) == 1 else Concat(parts, axis=1)  # [gate | up] after the experts' axis
        if self.arch.experts_in_out and ".mlp.experts." in name:  # gpt-oss: HF's [E, in, out], gate/up interleaved
            source = ExpertLayout(source, name, interleave=len(parts) > 1)
            source = ExpertLayout(source, name, swap=True) if len(source.shape) == 3 else source
        return AsRow(source) if name in self._row_vectors else source

    def _source(self, name: str, t: GGUFTensor) -> WeightSource:
        order = self._row_order(name, t)
        if t.type in FLOAT_TYPES or t.type in DEQUANTIZED_TYPES:
            return GGUFFloat(t, name, order)
        if len(t.shape) == 3:
            return GGUFExperts(t, name)
        kind = BLOCK_TYPES[t.type]
        n, k = t.shape
        if kind.widened and self.requantize != "none":
            bits = REQUANTIZE_BITS[self.requantize]
            return GGUFRequantized(lambda: quantize(self._exact(t, order), bits, INT4_BLOCK), bits, INT4_BLOCK, n, k,
                                   True, key=name, label=f"gguf_{t.type}_requantized")
        return GGUFWeight(lambda: self._arrays(t, order)[0], kind.bits, kind.block, n, k,
                          symmetric_layout(t.type, t.data),
                          key=name, label=f"gguf_{t.type}",
                          minimums=(lambda: self._arrays(t, order)[1]) if kind.minimum else None)

    def read(self, name: str) -> np.ndarray:
        return np.asarray(self.source(name).materialize(), np.float32)

    def read_slice(self, name: str, axis: int, lo: int, hi: int) -> np.ndarray:
        index = tuple([slice(None)] * axis + [slice(lo, hi)])
        return np.ascontiguousarray(self.read(name)[index])

    def _exact(self, t: GGUFTensor, order: np.ndarray | None) -> np.ndarray:
        """A minimum-free block tensor's dequantized value (gguf's own, bit for bit), float32 [N, K]."""
        kind = BLOCK_TYPES[t.type]
        return dequantize(self._arrays(t, order)[0], kind.bits, kind.block, t.shape[1])

    def _arrays(self, t: GGUFTensor, order: np.ndarray | None) -> tuple[QuantizedArrays, np.ndarray | None]:
        n, k = t.shape
        arrays, mins = repack(t.type, t.data, n, k)
        if order is None:
            return arrays, mins
        return (QuantizedArrays(*(None if a is None else a[order] for a in arrays)),
                None if mins is None else mins[order])

    def _row_order(self, name: str, t: GGUFTensor) -> np.ndarray | None:
        """The rows of a llama-family Q or K weight (or bias) in HF order, where the converter permuted them."""
        if not self.arch.permute_qk or not any(p in name for p in ("q_proj.", "k_proj.")):
            return None
        heads = self.config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
        return unpermute_rows(t.shape[0], heads)


def layers(config: dict) -> int:
    return config.get("num_hidden_layers", config.get("n_layer"))


@dataclass(eq=False)
class GGUFFloat(WeightSource):
    """An F32 / F16 / BF16 tensor read as float32 (rows reordered where `order` says); also an MXFP4 one
    (gpt-oss's experts), dequantized exactly (repack.read_mxfp4)."""

    tensor: GGUFTensor
    key: str
    order: np.ndarray | None = field(default=None, repr=False)
    reference_loads = True  # transformers reads the same file (builder/quant/weights.py reference_holds)

    def __post_init__(self) -> None:
        self.shape, self.dtype = self.tensor.shape, "float32"

    def materialize(self) -> np.ndarray:
        value = read_float(self.tensor.type, self.tensor.data).reshape(self.shape)
        return value if self.order is None else value[self.order]

    def __str__(self) -> str:
        return f'gguf_{self.tensor.type}["{self.key}"]'


@dataclass(eq=False)
class GGUFWeight(Prequantized):
    """A block-quantized GGUF tensor: MatMulNBits arrays plus, for the types with a float minimum, the
    per-block minimums [N, K / block] (`minimums()`), whose term builder/passes/add_block_minimums.py adds.
    materialize() is the file's dequantized value bit for bit: (code - zp) * scale (+ minimum)."""

    minimums: Callable[[], np.ndarray] | None = field(default=None, repr=False)
    reference_loads = True  # transformers reads the same file (builder/quant/weights.py reference_holds)

    def materialize(self) -> np.ndarray:
        value = dequantize(self.load(), self.bits, self.block, self.k)
        return value if self.minimums is None else value + np.repeat(self.minimums(), self.block, axis=1)


@dataclass(eq=False)
class GGUFExperts(WeightSource):
    """A block-quantized stacked expert tensor [E, N, K] (`blk.N.ffn_*_exps`). materialize() is the file's
    dequantized value bit for bit; `expert_arrays` gives QMoE's integers for a symmetric type without block
    minimums (Q4_0, Q5_0, Q8_0, Q3_K, Q6_K), the file's codes and scales in a layout of as many or more bits
    and as large or smaller blocks (so the gate/up and down experts of one layer can share one QMoE node):
    a 4-bit code c (zero point 8) is the 8-bit code c + 120 (zero point 128), a block's scale repeated over
    its halves makes blocks of 16 from blocks of 32; both exact."""

    tensor: GGUFTensor
    key: str
    reference_loads = True  # the reference reads the same file (load_reference; builder/quant/weights.py)

    def __post_init__(self) -> None:
        self.shape, self.dtype = self.tensor.shape, "float32"
        self.kind = BLOCK_TYPES[self.tensor.type]

    def _flat(self) -> GGUFWeight:
        """The experts' rows as one [E * N, K] weight."""
        experts, n, k = self.shape
        data = np.asarray(self.tensor.data).reshape(experts * n, -1)
        kind, rows = self.kind, experts * n
        return GGUFWeight(lambda: repack(self.tensor.type, data, rows, k)[0], kind.bits, kind.block, rows, k,
                          symmetric_layout(self.tensor.type, data), key=self.key,
                          minimums=(lambda: repack(self.tensor.type, data, rows, k)[1]) if kind.minimum else None)

    def materialize(self) -> np.ndarray:
        return self._flat().materialize().reshape(self.shape)

    def expert_layout(self) -> tuple[int, int] | None:
        """(bits, block) of the file's integers as QMoE reads them; None for a type with block minimums."""
        return (self.kind.bits, self.kind.block) if self.kind.symmetric and not self.kind.minimum else None

    def expert_arrays(self, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """QMoE's (q uint8 [E, N, K * bits / 8], scales float32 [E, N, K / block]) of the file's integers."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        own, ratio = self.expert_layout(), self.kind.block // block
        if own is None or bits < own[0] or block > own[1] or self.kind.block % block:
            raise ValueError(f"{self}: {self.tensor.type} cannot be read exactly as {bits}-bit blocks of {block}")
        experts, n, k = self.shape
        _, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.tensor.type]]
        blocks = self.kind.unpack(np.asarray(self.tensor.data).reshape(-1, size))
        codes = blocks.codes.reshape(experts, n, k // block, block)
        codes = codes + np.uint8(2 ** (bits - 1) - 2 ** (self.kind.bits - 1))  # the same value, a wider zero point
        scales = np.repeat(blocks.scales.reshape(experts, n, k // self.kind.block), ratio, axis=-1)
        return pack(codes, bits).reshape(experts, n, -1), np.ascontiguousarray(scales, np.float32)

    def __str__(self) -> str:
        return f'gguf_{self.tensor.type}_experts["{self.key}"]'


@dataclass(eq=False)
class AsRow(WeightSource):
    """A vector [H] read as the HF parameter [1, H] (Qwen2-MoE's shared_expert_gate)."""

    part: WeightSource
    reference_loads = True

    def __post_init__(self) -> None:
        self.shape, self.dtype = (1,) + tuple(self.part.shape), self.part.dtype

    def materialize(self) -> np.ndarray:
        return self.part.materialize().reshape(self.shape)

    def __str__(self) -> str:
        return f"as_row({self.part})"


@dataclass(eq=False)
class GGUFRequantized(GGUFWeight):
    """An i-quant tensor rounded again to fewer bits (recipe gguf.requantize): its value is no longer the
    file's, so verification gives transformers the engine's own weight (builder/quant/reference.py)."""

    reference_loads = False


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Any checkpoint directory: a staged GGUF file's, or builder/quant/imported.py's (float or pre-quantized)."""
    from builder.quant.imported import open_checkpoint as open_hf

    return GGUFCheckpoint(path) if is_staged(path) else open_hf(path)


def import_format(model_dir: str | Path):
    """The pre-quantized format of any checkpoint directory (a GGUFFormat for a staged GGUF file with block
    types), None for a float one."""
    from builder.quant.imported import import_format as hf_format

    return GGUFCheckpoint(model_dir).format if is_staged(model_dir) else hf_format(model_dir)


def load_reference(model_dir: str | Path):
    """transformers' model loaded from the same GGUF file (dequantized to float32 by transformers itself); for a
    family whose metadata transformers' GGUF loader does not fully read (Arch.reference_needs_config), with the
    staged config.json (the file's weights, llama.cpp's reading of its metadata); for one it cannot read at all
    (Arch.transformers_reads false: Mixtral's experts in a llama file), the staged config's model given the
    file's tensors as this reader dequantizes them (exact: tests/builder/test_gguf.py checks it against gguf); a
    file with rope scaling gets the staged config too (transformers' GGUF loader reads none of it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    file = source_file(model_dir)
    gguf = open_gguf(file)
    arch = arch_of(gguf)
    needs_config = reference_needs_config(gguf, arch) or not arch.transformers_reads
    config = AutoConfig.from_pretrained(str(model_dir)) if needs_config else None
    if not arch.transformers_reads:
        checkpoint = GGUFCheckpoint(model_dir)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():  # a tied lm_head is listed once, as the embedding
                param.copy_(torch.from_numpy(checkpoint.read(name)))
        return model
    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                **({"config": config} if config else {}))
