"""Model family specs: the declarative files in model_specs/ that map a Hugging Face config and
parameter names onto IR hyperparameters, block features and weights."""
from __future__ import annotations

import ast
import operator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml


class SpecError(ValueError):
    """The checkpoint's architecture or config is not covered by any model spec."""


# Block features a spec may switch on (`block:` in the yaml), with their defaults: the Llama block.
BLOCK_DEFAULTS: dict[str, Any] = {
    "norm": "rms",                  # rms | layer (LayerNorm with bias, GPT-2)
    "positions": "rotary",          # rotary | learned (an absolute position table, GPT-2)
    "mlp": "gated",                 # gated (act(gate) * up) | plain (down(act(up)), GPT-2)
    "linear_layout": "out_in",      # how Linear weights are stored: out_in (nn.Linear) | in_out (GPT-2 Conv1D)
    "norm_weight_offset": 0.0,      # Gemma's RMSNorm scales by (offset + weight)
    "embedding_scale": None,        # "sqrt_hidden": embeddings times sqrt(hidden_size) (Gemma)
}
BLOCK_CHOICES = {"norm": ("rms", "layer"), "positions": ("rotary", "learned"), "mlp": ("gated", "plain"),
                 "linear_layout": ("out_in", "in_out"), "embedding_scale": (None, "sqrt_hidden")}
LAYER_TYPES = {"full_attention": False, "sliding_attention": True}  # config.layer_types -> windowed?
# Mixture-of-experts features (`moe:` in the yaml), with their choices; builder/trace_moe.py reads them.
MOE_CHOICES = {
    "sparse_layers": ("every", "qwen_step"),   # which layers route: all, or Qwen's decoder_sparse_step rule
    "experts_layout": ("out_in_concatenated", "in_out_interleaved"),  # gate_up [E, 2I, H] [gate|up] | [E, H, 2I]
    "activation": ("silu", "clamped_swiglu"),  # silu(gate) * up | gpt-oss: clamped, gate*sigmoid(a*gate)*(up+1)
}


@dataclass(frozen=True)
class ModelSpec:
    """One architecture family, loaded from model_specs/<family>.yaml."""

    family: str
    architectures: tuple[str, ...]
    hyperparameters: dict[str, dict[str, Any]]
    activations: tuple[str, ...]
    rotary: dict[str, Any]
    weights: dict[str, Any]
    features: str = ""
    block: dict[str, Any] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    moe: dict[str, Any] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # related architectures not built, and why

    def __post_init__(self) -> None:
        unknown = sorted(set(self.block) - set(BLOCK_DEFAULTS))
        if unknown:
            raise SpecError(f"model_specs/{self.family}.yaml: unknown block features {unknown}; "
                            f"allowed: {sorted(BLOCK_DEFAULTS)}")
        object.__setattr__(self, "block", BLOCK_DEFAULTS | dict(self.block))
        for key, allowed in BLOCK_CHOICES.items():
            if self.block[key] not in allowed:
                raise SpecError(f"model_specs/{self.family}.yaml: block.{key} is {self.block[key]!r}; "
                                f"allowed: {list(allowed)}")
        for key, allowed in MOE_CHOICES.items():
            if self.moe and self.moe.get(key) not in allowed:
                raise SpecError(f"model_specs/{self.family}.yaml: moe.{key} is {self.moe.get(key)!r}; "
                                f"allowed: {list(allowed)}")

    def resolve(self, config: Any) -> dict[str, Any]:
        """Read the IR hyperparameters from a transformers config object."""
        self._refuse_unsupported(config)
        hp: dict[str, Any] = {}
        for name, rule in self.hyperparameters.items():
            hp[name] = _resolve_one(name, rule, config, hp)
        if hp["activation"] not in self.activations:
            raise SpecError(f"{self.family}: hidden_act {hp['activation']!r} is not supported; "
                            f"allowed: {list(self.activations)}")
        for kind in hp.get("layer_types") or []:
            if kind not in LAYER_TYPES:
                raise SpecError(f"{self.family}: config.layer_types has {kind!r}; supported: {sorted(LAYER_TYPES)}")
        return hp

    def _refuse_unsupported(self, config: Any) -> None:
        """Config fields this spec cannot honour yet: set to anything but null/false is an error naming them."""
        found = {key: why for key, why in self.unsupported.items() if getattr(config, key, None) not in (None, False)}
        if found:
            raise SpecError(f"{self.family}: config fields not supported by model_specs/{self.family}.yaml: "
                            + "; ".join(f"{key}={getattr(config, key)!r} ({why})" for key, why in found.items()))

    def layer_weights(self, layer: int, hp: dict[str, Any]) -> dict[str, tuple[str, bool]]:
        """IR weight name -> (HF parameter name, required) for one decoder layer. A sparse (routed) layer
        of a mixture-of-experts family has the `moe.layer` weights in place of the dense `moe.replaces`."""
        prefix = self.weights["layer_prefix"].format(layer=layer)
        names = dict(self.weights["layer"])
        if is_sparse_layer(self, hp, layer):
            names = {k: v for k, v in names.items() if k not in self.moe["replaces"]} | self.moe["layer"]
        return {key: (prefix + name.rstrip("?"), not name.endswith("?")) for key, name in names.items()}


def is_sparse_layer(spec: ModelSpec, hp: dict[str, Any], layer: int) -> bool:
    """Whether a layer's MLP is routed experts: every layer, or Qwen's rule (not in mlp_only_layers and
    (layer + 1) a multiple of decoder_sparse_step)."""
    if not spec.moe or not hp.get("num_experts"):
        return False
    if spec.moe["sparse_layers"] == "every":
        return True
    return layer not in (hp.get("mlp_only_layers") or []) and (layer + 1) % hp["decoder_sparse_step"] == 0


def window_of(hp: dict[str, Any], layer: int) -> int | None:
    """The sliding-window length of one layer (None: full causal attention)."""
    window, types = hp.get("sliding_window"), hp.get("layer_types")
    if window is None or (types is not None and not LAYER_TYPES[types[layer]]):
        return None
    return int(window)


def _resolve_one(name: str, rule: dict[str, Any], config: Any, hp: dict[str, Any]) -> Any:
    gate = rule.get("enabled_by")
    if gate is not None and getattr(config, gate, True) is False:
        return None
    for key in rule["keys"]:
        value = getattr(config, key, None)
        if value is not None:
            return value
    if "default" not in rule:
        raise SpecError(f"config has none of {rule['keys']} (needed for {name})")
    default = rule["default"]
    return evaluate(default, hp) if isinstance(default, str) else default


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv,
           ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow}


def evaluate(expression: str, names: dict[str, Any]) -> Any:
    """An integer arithmetic expression over already-resolved hyperparameters (`hidden_size / num_heads`):
    names, numbers and + - * / // ** only (`/` divides exactly as integers); anything else is an error,
    so a spec file cannot run code."""
    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name):
            if names.get(node.id) is None:
                raise SpecError(f"default {expression!r}: {node.id!r} is not a resolved hyperparameter")
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](walk(node.left), walk(node.right))
        raise SpecError(f"default {expression!r}: only names, numbers and + - * / // ** are allowed")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise SpecError(f"default {expression!r} is not an arithmetic expression: {error.msg}") from None
    return walk(tree)


def load_spec(family: str) -> ModelSpec:
    text = resources.files("model_specs").joinpath(f"{family}.yaml").read_text()
    data = yaml.safe_load(text)
    data["architectures"] = tuple(data["architectures"])
    data["activations"] = tuple(data["activations"])
    return ModelSpec(**data)


def all_specs() -> list[ModelSpec]:
    files = resources.files("model_specs").iterdir()
    return [load_spec(f.name[:-5]) for f in sorted(files, key=lambda f: f.name) if f.name.endswith(".yaml")]


def families_table() -> str:
    """One line per supported family: its architectures and the block features it exercises
    (`engine-build --list-families`)."""
    specs = all_specs()
    width = max(len(s.family) for s in specs)
    rows = [f"{s.family:<{width}} {', '.join(s.architectures):<58} {s.features}" for s in specs]
    return "\n".join([f"{'family':<{width}} {'architectures':<58} features"] + rows)


def spec_for(architecture: str) -> ModelSpec:
    """The spec covering a HF architecture name, or a SpecError listing the supported ones."""
    specs = all_specs()
    for spec in specs:
        if architecture in spec.architectures:
            return spec
    supported = sorted(a for s in specs for a in s.architectures)
    why = next((s.refused[architecture] for s in specs if architecture in s.refused), None)
    if why is not None:
        raise SpecError(f"architecture {architecture!r} is not supported: {why}; supported: {supported}")
    raise SpecError(f"architecture {architecture!r} is not covered by any model spec; supported: {supported}")


def linear_modules(family: str) -> dict[str, str]:
    """IR layer weight key -> its HF module's short name (q -> q_proj), for the keys that are 2-D linear
    weights of the family (norms and biases excluded by their names)."""
    layer = load_spec(family).weights["layer"]
    return {key: hf.rstrip("?").rsplit(".", 2)[-2] for key, hf in layer.items()
            if hf.rstrip("?").endswith(".weight") and "norm" not in key and "norm" not in hf}
