"""Model family specs: the declarative files in model_specs/ that map a Hugging Face config and
parameter names onto IR hyperparameters and weights."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml


class SpecError(ValueError):
    """The checkpoint's architecture or config is not covered by any model spec."""


@dataclass(frozen=True)
class ModelSpec:
    """One architecture family, loaded from model_specs/<family>.yaml."""

    family: str
    architectures: tuple[str, ...]
    block: str
    hyperparameters: dict[str, dict[str, Any]]
    norm: str
    activations: tuple[str, ...]
    rotary: dict[str, Any]
    weights: dict[str, Any]

    def resolve(self, config: Any) -> dict[str, Any]:
        """Read the IR hyperparameters from a transformers config object."""
        hp: dict[str, Any] = {}
        for name, rule in self.hyperparameters.items():
            hp[name] = _resolve_one(name, rule, config, hp)
        if hp["activation"] not in self.activations:
            raise SpecError(f"{self.family}: hidden_act {hp['activation']!r} is not supported; "
                            f"allowed: {list(self.activations)}")
        return hp

    def layer_weights(self, layer: int) -> dict[str, tuple[str, bool]]:
        """IR weight name -> (HF parameter name, required) for one decoder layer."""
        prefix = self.weights["layer_prefix"].format(layer=layer)
        return {key: (prefix + name.rstrip("?"), not name.endswith("?"))
                for key, name in self.weights["layer"].items()}


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
    if isinstance(default, str):
        return int(eval(default.replace("/", "//"), {"__builtins__": {}}, dict(hp)))
    return default


def load_spec(family: str) -> ModelSpec:
    text = resources.files("model_specs").joinpath(f"{family}.yaml").read_text()
    data = yaml.safe_load(text)
    data["architectures"] = tuple(data["architectures"])
    data["activations"] = tuple(data["activations"])
    return ModelSpec(**data)


def all_specs() -> list[ModelSpec]:
    files = resources.files("model_specs").iterdir()
    return [load_spec(f.name[:-5]) for f in sorted(files, key=lambda f: f.name) if f.name.endswith(".yaml")]


def spec_for(architecture: str) -> ModelSpec:
    """The spec covering a HF architecture name, or a SpecError listing the supported ones."""
    specs = all_specs()
    for spec in specs:
        if architecture in spec.architectures:
            return spec
    supported = sorted(a for s in specs for a in s.architectures)
    raise SpecError(f"architecture {architecture!r} is not covered by any model spec; supported: {supported}")
