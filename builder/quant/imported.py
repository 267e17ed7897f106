"""Pre-quantized checkpoints: config.json's `quantization_config` names the format; each quantized
module's stored integers, scales and zero points are repacked bit-exactly into MatMulNBits' layout
(builder/quant/formats/), never dequantized and rounded again.

`open_checkpoint` returns a Checkpoint whose quantized modules look like float `<m>.weight` tensors
[N, K] to the tracer; their weight source is a `Prequantized` one that QuantizeWeights writes as it
is. Supported: gptq (gptqmodel / auto-gptq; 4 or 8 bits; v1 or gptq_v2 zero points; desc_act, whose
columns are stored sorted by group and read by a permuted activation), awq (AutoAWQ GEMM, 4 bits), compressed-tensors pack-quantized
(W4A16 / W8A16, group or channel strategy, symmetric or not). Anything else is refused by name."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from builder.quant.formats.awq import read_awq
from builder.quant.formats.compressed import read_compressed
from builder.quant.formats.gptq import column_order, read_gptq
from builder.quant.formats.packing import block_for
from builder.quant.schemes import QuantizedArrays
from builder.quant.weights import Prequantized
from builder.weights import Checkpoint, CheckpointError, WeightSource

SUPPORTED = ("gptq (4 or 8 bits, checkpoint_format gptq or gptq_v2), awq (4-bit GEMM), compressed-tensors "
             "(pack-quantized, 4 or 8-bit int weights, group or channel strategy, no activation quantization), "
             "mxfp4 (gpt-oss experts, dequantized at build)")
SPEC_FORMATS = ("mxfp4",)  # quant_methods a family spec reads (builder/trace_moe.py Mxfp4Experts)


@dataclass(frozen=True)
class ImportFormat:
    """One checkpoint's quantization: `group` -1 is one group per output channel; `marker` the tensor
    suffix of a quantized module; `read(read_tensor, module)` -> (arrays, block, N, K); `order(read_tensor,
    module, K)` -> the weight column each stored column holds (None: in order), for formats that permute."""

    name: str
    bits: int
    group: int
    symmetric: bool
    marker: str
    read: Callable = field(repr=False)
    config: dict = field(default_factory=dict, repr=False)
    order: Callable | None = field(default=None, repr=False)

    def record(self) -> dict:
        """What the manifest keeps: the source format and its settings as config.json states them."""
        return {"format": self.name, "bits": self.bits, "group_size": self.group, "symmetric": self.symmetric,
                "quantization_config": self.config}


def import_format(model_dir: str | Path) -> ImportFormat | None:
    """The checkpoint's pre-quantized format, None for a float checkpoint; an unsupported one is an error."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    if config is None:
        return None
    method = str(config.get("quant_method", "<no quant_method>"))
    if method in SPEC_FORMATS:  # read by the family spec itself (model_specs/gpt_oss.yaml: stored: mxfp4)
        return None
    if method not in PARSERS:
        raise CheckpointError(f"{path}: quantization_config.quant_method {method!r} is not supported; "
                              f"supported: {SUPPORTED}")
    return PARSERS[method](config, path)


def _gptq(config: dict, path: Path) -> ImportFormat:
    bits, group = config.get("bits"), int(config.get("group_size", 128))
    layout = config.get("checkpoint_format", config.get("format", "gptq"))
    _allowed(path, "gptq", "bits", bits, (4, 8))
    _allowed(path, "gptq", "checkpoint_format", layout, ("gptq", "gptq_v2"))
    symmetric = bool(config.get("sym", True))
    return ImportFormat("gptq" if layout == "gptq" else "gptq_v2", bits, group, symmetric, ".qweight",
                        lambda read, m: read_gptq(read, m, bits, group, symmetric, layout == "gptq_v2"), config,
                        lambda read, m, k: column_order(read, m, k, group))


def _awq(config: dict, path: Path) -> ImportFormat:
    bits = config.get("bits", config.get("w_bit"))
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    _allowed(path, "awq", "version", str(config.get("version", "gemm")).lower(), ("gemm",))
    _allowed(path, "awq", "bits", bits, (4,))
    symmetric = not config.get("zero_point", True)
    return ImportFormat("awq", 4, group, symmetric, ".qweight",
                        lambda read, m: read_awq(read, m, group, symmetric), config)


def _compressed(config: dict, path: Path) -> ImportFormat:
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise CheckpointError(f"{path}: compressed-tensors quantization_config has no config_groups")
    weights = [g.get("weights") or {} for g in groups]
    if any(w != weights[0] for w in weights):
        raise CheckpointError(f"{path}: compressed-tensors config_groups quantize weights differently; supported: "
                              f"one weight scheme for every group")
    for g in groups:
        _allowed(path, "compressed-tensors", "format", g.get("format") or config.get("format"), ("pack-quantized",))
        _allowed(path, "compressed-tensors", "input_activations", g.get("input_activations"), (None,))
    w = weights[0]
    _allowed(path, "compressed-tensors", "weights.type", w.get("type"), ("int",))
    _allowed(path, "compressed-tensors", "weights.num_bits", w.get("num_bits"), (4, 8))
    _allowed(path, "compressed-tensors", "weights.strategy", w.get("strategy"), ("group", "channel"))
    _allowed(path, "compressed-tensors", "weights.actorder", w.get("actorder"), (None, "static"))
    bits, symmetric = w["num_bits"], bool(w.get("symmetric", True))
    group = int(w["group_size"]) if w["strategy"] == "group" else -1
    return ImportFormat("compressed-tensors", bits, group, symmetric, ".weight_packed",
                        lambda read, m: read_compressed(read, m, bits, group, symmetric), config)


def _allowed(path: Path, method: str, key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise CheckpointError(f"{path}: {method} quantization_config {key}={value!r} is not supported; supported: "
                              f"{key} in {list(allowed)} ({SUPPORTED})")


PARSERS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed}


class QuantizedCheckpoint(Checkpoint):
    """A checkpoint whose quantized modules `<m>` read as float tensors `<m>.weight` [N, K]."""

    def __init__(self, path: str | Path, fmt: ImportFormat):
        super().__init__(path)
        self.format = fmt
        raw = super().names()
        self.modules = {name[:-len(fmt.marker)] for name in raw if name.endswith(fmt.marker)}
        self._dims: dict[str, tuple[int, int]] = {}

    def _module(self, name: str) -> str | None:
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        return module if module in self.modules else None

    def names(self) -> set[str]:
        return super().names() | {f"{m}.weight" for m in self.modules}

    def shape(self, name: str) -> tuple[int, ...]:
        module = self._module(name)
        return super().shape(name) if module is None else self._shape(module)

    def describe(self, name: str) -> str:
        module = self._module(name)
        return name if module is None else f"{name} (stored as {module}{self.format.marker}, {self.format.name})"

    def dtype(self, name: str) -> str:
        return "F32" if self._module(name) else super().dtype(name)

    def read(self, name: str) -> np.ndarray:
        module = self._module(name)
        if module is None:
            return super().read(name)
        return self.source(name).materialize()

    def source(self, name: str) -> WeightSource:
        module = self._module(name)
        if module is None:
            return super().source(name)
        n, k = self._shape(module)
        block = block_for(k if self.format.group == -1 else self.format.group, k)
        order = self.format.order(super().read, module, k) if self.format.order else None
        return Prequantized(lambda: self.arrays(module), self.format.bits, block, n, k, self.format.symmetric,
                            key=name, label=self.format.name, order=order)

    def arrays(self, module: str) -> QuantizedArrays:
        return self.format.read(super().read, module)[0]

    def _shape(self, module: str) -> tuple[int, int]:
        """(N, K) from the stored tensors' shapes (compressed-tensors stores it)."""
        if module not in self._dims:
            marker = super().shape(module + self.format.marker)
            bits = self.format.bits
            if self.format.name == "compressed-tensors":
                n, k = (int(v) for v in super().read(f"{module}.weight_shape").reshape(-1)[:2])
            elif self.format.name == "awq":
                n, k = marker[1] * 8, marker[0]
            else:
                n, k = marker[1], marker[0] * 32 // bits
            self._dims[module] = (n, k)
        return self._dims[module]


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`, reading a pre-quantized one's modules through its format."""
    fmt = import_format(path)
    return Checkpoint(path) if fmt is None else QuantizedCheckpoint(path, fmt)
