"""MatMulNBits accuracy_level per layer kind. `quantization.accuracy_level` is one level for every
quantized matmul, or a mapping from layer kind to level with an optional `default` (the target's default
when absent): `{default: 4, lm_head: 1}`. A layer kind is the last part of a linear's IR weight name
(`layers.3.gate_up` -> `gate_up`; `qkv`, `o`, `gate_up`, `down` after the fusions, `q`, `k`, `v`, `gate`,
`up` without them), `lm_head` for the output projection (tied or not), `experts` for MoE experts. A fused
kind's name also covers its parts where they stay apart (`qkv` sets `q`, `k`, `v` where a GGUF file stores them
in different types, e.g. Q4_K q/k beside a Q6_K v; `gate_up` sets `gate`, `up`), so one recipe serves every family. Level 0/1
computes in float32 (exact with the stored weights), 4 quantizes activations to int8 on the fly (fast on
CPU, ~1% relative error per matmul); a key naming no kind of the model is an error listing its kinds.

`auto` picks per matmul instead: each starts at the fastest kernel of its bits and block in this CPU's measured
table (builder/quant/kernels.py; never a pathological one), and the build then moves groups of matmuls to float
activations while the engine's perplexity on the calibration text is further than `quantization.accuracy_budget`
from the same weights in float (builder/kernel_choice.py). The manifest records each matmul's level and why.

`quantization.activation_block` (one block, or a mapping from layer kind to block with an optional `default`) runs
those matmuls that have int8 activations at a smaller MatMulNBits block than they are stored in: the same values
re-blocked exactly (builder/quant/weights.py `reblock`), so ONNX Runtime's int8 path, which quantizes the
activations per block of the weight's, rounds them per that many values. On SmolLM2's Q4_1 / Q4_0 / Q8_0 files qkv
and the head at 16 instead of 32 moved top-1 agreement with float from a hair below llama.cpp's to above it for
1-5% of decode time (docs/ACCURACY.md). `activation_block: auto` (with `accuracy_level: auto`) leaves the choice
to the build: it re-blocks each layer kind whose re-block, measured against float, removes a larger share of the
int8 rounding's KL divergence than the share of matmul time it adds (builder/kernel_choice.py). With
`accuracy_level: auto` the kernel choice also offers re-blocks as steps where the budget is not held."""
from __future__ import annotations

from dataclasses import dataclass, field

from builder.quant.kernels import KernelTable

LEVELS = (0, 1, 2, 3, 4)
DEFAULT = "default"
FUSED_KIND = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}  # a part -> its fused kind
AUTO = "auto"


def layer_kind(weight: str, head: bool) -> str:
    """The layer kind of a linear's IR weight name; `head`: it computes the logits."""
    return "lm_head" if head else weight.rsplit(".", 1)[-1]


@dataclass
class AccuracyLevels:
    """Resolved levels: `default` for every kind not in `by_kind`."""

    default: int
    by_kind: dict[str, int] = field(default_factory=dict)
    auto: bool = False

    @classmethod
    def from_setting(cls, setting: int | str | dict[str, int] | None, target_default: int) -> AccuracyLevels:
        if setting is None:
            return cls(target_default)
        if setting == AUTO:
            return cls(target_default, auto=True)
        if isinstance(setting, int):
            return cls(setting)
        by_kind = dict(setting)
        return cls(by_kind.pop(DEFAULT, target_default), by_kind)

    def level(self, kind: str) -> int:
        """The level of one layer kind: its own key, else its fused kind's (`q` -> `qkv`), else the default."""
        return self.by_kind.get(kind, self.by_kind.get(FUSED_KIND.get(kind), self.default))

    def choose(self, kind: str, bits: int, block: int, table: KernelTable) -> dict:
        """One matmul's choice, {kind, bits, block, level, why}: the recipe's level of its kind, or with `auto`
        the fastest kernel of its bits and block in this CPU's table (the build may move it to float activations
        after measuring, builder/kernel_choice.py)."""
        if not self.auto:
            level, why = self.level(kind), "recipe"
        else:
            level = table.fastest(bits, block)
            why = f"fastest ({table.describe(bits, block)})"
        return {"kind": kind, "bits": bits, "block": block, "level": level, "why": why}

    def check_kinds(self, kinds: set[str]) -> None:
        """Every kind the setting names must be one of the model's quantized layer kinds, or the fused kind of
        some of them (`qkv` on separate q/k/v)."""
        check_kind_keys("quantization.accuracy_level", set(self.by_kind), kinds)

    def record(self, kinds: set[str], matmuls: dict[str, dict] | None = None) -> dict:
        """For the manifest, over the model's `kinds`: `accuracy_level` the highest level used (>= 2: some
        activations are quantized on the fly, what readers of one level ask), and, when the setting was
        per kind, `accuracy_levels` the level of each kind; with `auto`, `matmuls` each matmul's choice."""
        if self.auto:
            return record_choices(matmuls or {}, self.default, kinds)
        used = {kind: self.level(kind) for kind in sorted(kinds)}
        record = {"accuracy_level": max(used.values(), default=self.default)}
        return dict(record, accuracy_levels=used) if self.by_kind else record


@dataclass(frozen=True)
class ActivationBlocks:
    """`quantization.activation_block` resolved: `default` for kinds not in `by_kind` (None: as stored)."""

    default: int | None = None
    by_kind: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_setting(cls, setting: int | str | dict[str, int] | None) -> ActivationBlocks:
        """`auto` starts as stored: the kernel choice measures which kinds to re-block (builder/kernel_choice.py)."""
        if setting == AUTO:
            return cls()
        if isinstance(setting, dict):
            by_kind = dict(setting)
            return cls(by_kind.pop(DEFAULT, None), by_kind)
        return cls(setting)

    def run_block(self, kind: str, bits: int, block: int, level: int) -> int | None:
        """The smaller block a matmul of `kind` runs at: its kind's setting (or its fused kind's, or the default)
        where it has int8 activations (level 4) and the setting re-blocks its stored `block` exactly; else None."""
        wanted = self.by_kind.get(kind, self.by_kind.get(FUSED_KIND.get(kind), self.default))
        if wanted is None or level != 4 or wanted >= block or block % wanted or wanted * bits % 8:
            return None
        return wanted

    def check_kinds(self, kinds: set[str]) -> None:
        check_kind_keys("quantization.activation_block", set(self.by_kind), kinds)


def check_kind_keys(where: str, keys: set[str], kinds: set[str]) -> None:
    """Every key must be one of the model's quantized layer kinds, or the fused kind of some of them."""
    kinds = kinds | {FUSED_KIND[kind] for kind in kinds if kind in FUSED_KIND}
    unknown = sorted(keys - kinds)
    if unknown:
        raise ValueError(f"{where}: {', '.join(map(repr, unknown))} "
                         f"{'is not a layer kind' if len(unknown) == 1 else 'are not layer kinds'} of this "
                         f"model's quantized matmuls; allowed keys: {', '.join([DEFAULT, *sorted(kinds)])}")


ACTIVATION_BLOCKS = (16, 32, 64, 128)  # MatMulNBits blocks a larger stored one can be re-blocked to


def check_activation_block(setting: int | str | dict[str, int] | None) -> None:
    """Recipe-time check of `quantization.activation_block` (its kinds are checked against the model at build)."""
    if setting is None or setting == AUTO:
        return
    if isinstance(setting, str):
        raise ValueError(f"quantization.activation_block: {setting!r} is not {AUTO!r}, a block "
                         f"{list(ACTIVATION_BLOCKS)} or a mapping from layer kind to block")
    values = setting.items() if isinstance(setting, dict) else [("", setting)]
    for kind, block in values:
        if block not in ACTIVATION_BLOCKS or isinstance(block, bool):
            where = f"quantization.activation_block{'.' + kind if kind else ''}"
            raise ValueError(f"{where}: {block!r} is not one of {list(ACTIVATION_BLOCKS)} (the MatMulNBits block "
                             f"int8 activations round in; a matmul stored in larger blocks it divides is re-blocked "
                             f"exactly)")


def record_choices(matmuls: dict[str, dict], default: int, kinds: set[str] = frozenset()) -> dict:
    """The manifest's record of per-matmul choices: the highest level, each kind's highest, and every matmul."""
    by_kind: dict[str, int] = {kind: default for kind in kinds if kind == "experts"}
    for choice in matmuls.values():
        by_kind[choice["kind"]] = max(by_kind.get(choice["kind"], 0), choice["level"])
    return {"accuracy_level": max(by_kind.values(), default=default), "accuracy_levels": dict(sorted(by_kind.items())),
            "matmuls": matmuls}


def check_setting(setting: int | str | dict[str, int] | None) -> None:
    """Recipe-time check of the setting's form (its kinds are checked against the model at build time)."""
    if isinstance(setting, str) and setting != AUTO:
        raise ValueError(f"quantization.accuracy_level: {setting!r} is not {AUTO!r}, a level {list(LEVELS)} or a "
                         f"mapping from layer kind to level")
    if setting == AUTO:
        return
    values = setting.items() if isinstance(setting, dict) else [("", setting)] if setting is not None else []
    for kind, level in values:
        if level not in LEVELS or isinstance(level, bool):
            where = f"quantization.accuracy_level{'.' + kind if kind else ''}"
            raise ValueError(f"{where}: {level!r} is not one of {list(LEVELS)} (0/1: float32 activations, "
                             f"4: int8 activations)")
