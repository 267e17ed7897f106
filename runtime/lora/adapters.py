"""Reading a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into the engine's layout:
per adapted linear of the manifest's `lora` section, A [in, rank] and B [rank, out] with the scaling folded into
B, zero-padded to the engine's max_rank (a fused projection's modules side by side). What the engine cannot
serve is refused by name."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.manifest.types import Lora, LoraLinear


class AdapterError(ValueError):
    """The adapter cannot be served by this engine: the message names the field and what is allowed."""


# adapter_config.json fields the engine does not implement: refused when set (not their PEFT default)
UNSUPPORTED = {"use_dora": False, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
               "rank_pattern": {}, "alpha_pattern": {}}
KEY = re.compile(r"layers\.(\d+)\.(?:[\w.]*\.)?(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class Adapter:
    """One adapter in the engine's layout: linear input name (LoraLinear.a) -> (A [in, R], B [R, out])."""

    name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def read_adapter(name: str, path: str | Path, lora: Lora) -> Adapter:
    """The PEFT adapter at `path`, checked against the engine's `lora` section."""
    path = Path(path)
    config = _config(path)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {name!r}: adapter_config.json r must be a positive integer, not {rank!r}")
    if rank > lora.max_rank:
        raise AdapterError(f"adapter {name!r}: r = {rank} is above this engine's lora.max_rank {lora.max_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _tensors(name, path)
    found = _by_module(name, tensors, lora)
    weights = {}
    for linear in lora.linears:
        parts = [found.pop((linear.layer, m), None) for m in linear.modules]
        if any(p is not None for p in parts):
            weights[linear.a] = _place(name, linear, parts, lora.max_rank, scaling)
    return Adapter(name, rank, scaling, weights)


def _config(path: Path) -> dict:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: no adapter_config.json (a PEFT LoRA directory has adapter_config.json and "
                           f"adapter_model.safetensors)") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config['peft_type']!r} is not supported; allowed: LORA")
    for key, default in UNSUPPORTED.items():
        if config.get(key) not in (default, None, [], {}, False):
            raise AdapterError(f"{path}: adapter_config.json {key} = {config[key]!r} is not supported; "
                               f"allowed: {default!r}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: adapter_config.json bias = {config['bias']!r} is not supported; allowed: 'none'")
    return config


def _tensors(name: str, path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    file = path / "adapter_model.safetensors"
    if not file.exists():
        raise AdapterError(f"adapter {name!r}: {file} is missing (only safetensors adapters are read)")
    return {k: v.astype(np.float32) for k, v in load_file(str(file)).items()}


def _by_module(name: str, tensors: dict[str, np.ndarray], lora: Lora) -> dict[tuple[int, str], tuple]:
    """(layer, module) -> (A [r, in], B [out, r]); a tensor of a module the engine was not built with is refused."""
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    built = {(lin.layer, m) for lin in lora.linears for m in lin.modules}
    outside: set[str] = set()
    for key, value in tensors.items():
        match = KEY.search(key)
        if not match:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B of a decoder layer's linear "
                               f"(embedding and lm_head adapters are not supported); this engine adapts "
                               f"{list(lora.targets)}")
        layer, module, side = int(match[1]), match[2], match[3]
        if (layer, module) not in built:
            outside.add(module)
            continue
        pairs.setdefault((layer, module), {})[side] = value
    if outside:
        raise AdapterError(f"adapter {name!r}: target_modules {sorted(outside)} are not ones this engine was built "
                           f"with; its lora.targets are {list(lora.targets)}")
    for (layer, module), sides in pairs.items():
        if set(sides) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(sides)} only")
    return {k: (v["A"], v["B"]) for k, v in pairs.items()}


def _place(name: str, linear: LoraLinear, parts: list, max_rank: int, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """A [in, R*modules] and B [R*modules, out] of one engine linear: each module's A.T in its rank block, its
    B.T * scaling in its rank block and output columns (block-diagonal for a fused projection)."""
    width = len(linear.modules) * max_rank
    a = np.zeros((linear.in_features, width), np.float32)
    b = np.zeros((width, sum(linear.widths)), np.float32)
    column = 0
    for i, (module, out, part) in enumerate(zip(linear.modules, linear.widths, parts)):
        if part is not None:
            pa, pb = part
            r = pa.shape[0]
            if pa.shape != (r, linear.in_features) or pb.shape != (out, r):
                raise AdapterError(f"adapter {name!r}: layer {linear.layer} {module} lora_A {list(pa.shape)} / "
                                   f"lora_B {list(pb.shape)} do not fit the engine's [r, {linear.in_features}] / "
                                   f"[{out}, r] (r <= {max_rank})")
            if r > max_rank:
                raise AdapterError(f"adapter {name!r}: layer {linear.layer} {module} has rank {r}, above "
                                   f"lora.max_rank {max_rank}")
            a[:, i * max_rank:i * max_rank + r] = pa.T
            b[i * max_rank:i * max_rank + r, column:column + out] = pb.T * scaling
        column += out
    return a, b
