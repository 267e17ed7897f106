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

from builder.gguf.arch import Arch, arch_of, hf_config, tensor_names, unpermute_rows
from builder.gguf.reader import GGUFError, GGUFModel, GGUFTensor, open_gguf
from builder.gguf.repack import BLOCK_TYPES, FLOAT_TYPES, read_float, repack, symmetric_layout, unsupported
from builder.quant.schemes import QuantizedArrays, dequantize
from builder.quant.weights import Prequantized
from builder.weights import Checkpoint, CheckpointError, WeightSource

SOURCE_FILE = "gguf_source.json"
STAGE_VERSION = 2  # bump when what a stage holds changes (reused while the file and this are unchanged)


def is_gguf_model(path: str | Path) -> bool:
    """A recipe `model:` naming a GGUF file."""
    return str(path).endswith(".gguf")


def is_staged(model_dir: str | Path) -> bool:
    """A checkpoint directory staged from a GGUF file by `stage_gguf`."""
    return (Path(model_dir) / SOURCE_FILE).is_file()


def staged_recipe(recipe, log: Callable[[str], None] = print):
    """`recipe` with each .gguf file it names (`model`, `speculative.draft_model`) replaced by its staged
    directory; as is when it names none."""
    draft = recipe.speculative.draft_model
    if is_gguf_model(recipe.model):
        recipe = dataclasses.replace(recipe, model=str(stage_gguf(recipe.model, log)))
    if draft is not None and is_gguf_model(draft):
        staged = str(stage_gguf(draft, log, field="speculative.draft_model"))
        recipe = dataclasses.replace(recipe, speculative=dataclasses.replace(recipe.speculative, draft_model=staged))
    return recipe


def as_given(path: str | Path) -> str:
    """What a recipe gave for a checkpoint: the GGUF file a staged directory stands for, else `path`."""
    return str(source_file(path)) if is_staged(path) else str(path)


def stage_gguf(path: str | Path, log: Callable[[str], None] = print, field: str = "model") -> Path:
    """The staged checkpoint directory of the GGUF file at `path` (under the user cache; rewritten on each
    call, so it always describes the file as it is now): config.json, tokenizer files, gguf_source.json.
    `field`: the recipe field that names the file, for the error when there is none."""
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
    stage = _cache_root() / f"{path.stem}-{key}"
    stat = path.stat()
    source = {"file": str(path.resolve()), "parts": [str(p) for p in model.files], "size": stat.st_size,
              "mtime_ns": stat.st_mtime_ns, "architecture": model.architecture, "stage_version": STAGE_VERSION}
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
    counts = Counter(t.type for t in model.tensors.values())
    log(f"gguf: {path.name}: {model.architecture}, {len(model.tensors)} tensors "
        f"({', '.join(f'{n} {t}' for t, n in counts.most_common())}); staged config and tokenizer in {stage}")
    return stage


def _cache_root() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "engine-builder" / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _refuse_types(model: GGUFModel) -> None:
    for t in model.tensors.values():
        if t.type not in BLOCK_TYPES and t.type not in FLOAT_TYPES:
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

    def record(self) -> dict:
        counts = Counter(self.types.values())
        return {"format": self.name, "bits": "per tensor", "file": self.file, "staged": self.staged,
                "type_counts": dict(counts), "tensor_types": dict(self.types)}


class GGUFCheckpoint(Checkpoint):
    """A staged GGUF checkpoint: tensors under their HF names, read from the file on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.model = open_gguf(source_file(self.path))
        self.arch: Arch = arch_of(self.model)
        self.config = json.loads((self.path / "config.json").read_text())
        self._gguf = tensor_names(self.model, self.arch, layers(self.config))
        _refuse_types(self.model)
        types = {hf: self.model.tensors[g].type for hf, g in self._gguf.items()}
        quantized = any(t in BLOCK_TYPES for t in types.values())
        self.format = GGUFFormat(str(self.model.path), types, str(self.path)) if quantized else None

    def names(self) -> set[str]:
        return set(self._gguf)

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self._gguf:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in {self.model.path.name}")
        return self.model.tensors[self._gguf[name]]

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF parameter's shape (GPT-2's Conv1D linears are [in, out]; their sources stay [out, in])."""
        shape = self.tensor(name).shape
        return shape[::-1] if self.stored_out_in(name) else shape

    def stored_out_in(self, name: str) -> bool:
        """A linear weight HF stores [in, out] that the file holds [out, in], read as the file holds it."""
        return self.arch.linears_out_in and name.endswith(".weight") and len(self.tensor(name).shape) == 2 \
            and not any(k in name for k in ("wte", "wpe", "lm_head"))

    def dtype(self, name: str) -> str:
        t = self.tensor(name)
        return t.type if t.type in FLOAT_TYPES else "F32"  # a block type reads as float32

    def describe(self, name: str) -> str:
        t = self.tensor(name)
        return f"{name} (GGUF {t.name}, {t.type})"

    def source(self, name: str) -> WeightSource:
        t = self.tensor(name)
        order = self._row_order(name, t)
        if t.type in FLOAT_TYPES:
            return GGUFFloat(t, name, order)
        kind = BLOCK_TYPES[t.type]
        n, k = t.shape
        return GGUFWeight(lambda: self._arrays(t, order)[0], kind.bits, kind.block, n, k,
                          symmetric_layout(t.type, t.data),
                          key=name, label=f"gguf_{t.type}",
                          minimums=(lambda: self._arrays(t, order)[1]) if kind.minimum else None)

    def read(self, name: str) -> np.ndarray:
        return np.asarray(self.source(name).materialize(), np.float32)

    def read_slice(self, name: str, axis: int, lo: int, hi: int) -> np.ndarray:
        index = tuple([slice(None)] * axis + [slice(lo, hi)])
        return np.ascontiguousarray(self.read(name)[index])

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
    """An F32 / F16 / BF16 tensor read as float32 (rows reordered where `order` says)."""

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
    staged config.json (the file's weights, llama.cpp's reading of its metadata)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    file = source_file(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir)) if arch_of(open_gguf(file)).reference_needs_config else None
    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                **({"config": config} if config else {}))
