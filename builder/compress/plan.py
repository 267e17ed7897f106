"""The pruning plan: what the student keeps, as data (CLI flags or a YAML file), checked against the teacher's
config before any work."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

DEPTH_METRICS = ("block", "perplexity")


class CompressError(ValueError):
    """A bad plan, input or state: the message names the problem and what is allowed."""


@dataclass(frozen=True)
class PrunePlan:
    """Sizes the student keeps (None: as the teacher). `layers`: decoder layers kept, chosen by block importance
    (cosine distance between a block's input and output) or by the perplexity increase of removing each;
    `heads`: attention heads per layer, whole KV groups; `ffn`: MLP intermediate channels; `hidden`: hidden
    (embedding) channels."""

    layers: int | None = None
    heads: int | None = None
    ffn: int | None = None
    hidden: int | None = None
    depth_metric: str = "block"

    def __post_init__(self) -> None:
        if self.depth_metric not in DEPTH_METRICS:
            raise CompressError(f"plan: depth_metric {self.depth_metric!r} is not one of {', '.join(DEPTH_METRICS)}")
        for name in ("layers", "heads", "ffn", "hidden"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise CompressError(f"plan: {name} must be a positive integer (how many to keep), got {value!r}")

    @property
    def prunes(self) -> bool:
        return any(getattr(self, name) is not None for name in ("layers", "heads", "ffn", "hidden"))

    def check(self, config) -> None:
        """Raise CompressError when the plan does not fit the teacher's `config` (a transformers config)."""
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        limits = {"layers": config.num_hidden_layers, "heads": heads, "ffn": config.intermediate_size,
                  "hidden": config.hidden_size}
        for name, limit in limits.items():
            value = getattr(self, name)
            if value is not None and value > limit:
                raise CompressError(f"plan: {name}={value} keeps more than the teacher has ({limit}); "
                                    f"give 1..{limit}")
        group = heads // kv
        if self.heads is not None and self.heads % group:
            allowed = ", ".join(str(group * g) for g in range(1, kv + 1))
            raise CompressError(f"plan: heads={self.heads} does not split into whole KV groups: the teacher has "
                                f"{heads} heads in {kv} groups of {group}; give one of {allowed}")
        hidden, kept_heads = self.hidden or config.hidden_size, self.heads or heads
        if hidden % kept_heads:
            raise CompressError(f"plan: hidden={hidden} is not a multiple of the {kept_heads} attention heads kept "
                                f"(transformers refuses such a Llama config); give a hidden size divisible by "
                                f"{kept_heads}")


def plan_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(PrunePlan))


def load_plan(path: str | Path | None, **flags) -> PrunePlan:
    """A plan from a YAML mapping of PrunePlan's fields (optional), with the non-None `flags` on top."""
    data: dict = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if not isinstance(loaded, dict):
            raise CompressError(f"{path}: a plan is a YAML mapping of {', '.join(plan_fields())}")
        data = loaded
    unknown = sorted(set(data) - set(plan_fields()))
    if unknown:
        raise CompressError(f"{path}: unknown plan keys {', '.join(unknown)}; allowed: {', '.join(plan_fields())}")
    data.update({k: v for k, v in flags.items() if v is not None})
    return PrunePlan(**data)
