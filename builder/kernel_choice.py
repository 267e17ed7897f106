"""Kernel choice by measurement (`quantization.accuracy_level: auto`): QuantizeWeights gave every matmul the
fastest kernel of its bits and block in this CPU's table (builder/quant/kernels.py); here, on the engine just
written, the build measures what that costs: perplexity on a few windows of the calibration text against
transformers running the engine's own weights in float (for a GGUF file: the file dequantized). While it is more
than `quantization.accuracy_budget` above, groups of matmuls (one layer kind at one bits and block) move to float
activations, the group that buys the most perplexity per microsecond of table time first (each measured alone
once), every step measured. Pathological kernels (8-bit at float activations: 25-90x slower) are tried only when
no other group is left, and the record says so. Only `accuracy_level` attributes of model.onnx change."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from builder.quant.calibration import calibration_sequences
from builder.quant.kernels import FLOAT, KernelTable
from builder.quant.levels import record_choices
from runtime.manifest.load import Manifest
from runtime.manifest.types import QuantizationRecord

WINDOWS, WINDOW = 6, 256  # ~1.5k tokens: a paired difference, so small changes show above the noise


@dataclass(frozen=True)
class Group:
    """The matmuls of one layer kind at one bits and block: what moves to float activations together."""

    kind: str
    bits: int
    block: int

    def __str__(self) -> str:
        return f"{self.kind} ({self.bits}-bit, block {self.block})"


def choose_kernels(engine_dir: Path, manifest: Manifest, model_dir: Path, budget: float, calibration: str | None,
                   reference: Callable[[list[list[int]]], list[np.ndarray]], log) -> Manifest:
    """The manifest with each matmul's measured choice; model.onnx's levels rewritten to match."""
    record = dict(manifest.quantization.record)
    matmuls = {name: dict(choice) for name, choice in record["matmuls"].items()}
    table = KernelTable.for_this_cpu()
    sequences = _windows(model_dir, calibration, min(WINDOW, manifest.limits.max_seq_len - 1))
    nll_float = _nll(reference(sequences), sequences)

    def cost(levels: dict[str, int]) -> float:
        _write_levels(engine_dir, levels)
        from builder.reference_check import engine_logits
        return float(np.exp(_nll(engine_logits(engine_dir, sequences, "cpu", manifest), sequences) - nll_float) - 1)

    levels = {name: choice["level"] for name, choice in matmuls.items()}
    found = search(_groups(matmuls), levels, cost, budget, table, record["quantized"], log)
    levels, change, moved, forced, trail = found.levels, found.change, found.moved, found.forced, found.trail
    _write_levels(engine_dir, levels)
    for name, choice in matmuls.items():
        choice["level"] = levels[name]
        group = Group(choice["kind"], choice["bits"], choice["block"])
        if group in forced:
            choice["why"] = (f"float activations forced by the budget although pathological here "
                             f"({table.describe(group.bits, group.block)})")
        elif group in moved:
            choice["why"] = f"float activations for accuracy ({table.describe(group.bits, group.block)})"
    within = change <= budget
    if not within:
        log(f"kernels: perplexity {change:+.2%} is still above the budget {budget:.0%} with every useful group at "
            f"float activations; kept")
    record.update(record_choices(matmuls, record.get("accuracy_level", 4),
                                 {"experts"} if "experts" in record.get("accuracy_levels", {}) else set()))
    record["kernel_choice"] = {
        "isa": table.isa, "cpu_flags": list(table.flags), "table": table.measured or "none for this ISA: rule",
        "budget": budget, "windows": len(sequences), "window": len(sequences[0]), "perplexity_change": change,
        "within_budget": within, "steps": [{"step": step, "perplexity_change": c} for step, c in trail],
        "forced_pathological": [str(g) for g in forced]}
    return manifest.replace(quantization=QuantizationRecord(manifest.quantization.mode, record))


@dataclass
class Found:
    """What search found: each matmul's level, the perplexity change measured last, the groups moved to float
    activations (`forced`: pathological ones), and each measured step."""

    levels: dict[str, int]
    change: float
    moved: list[Group]
    forced: list[Group]
    trail: list[tuple[str, float]]


def search(groups: dict[Group, list[str]], levels: dict[str, int], cost: Callable[[dict[str, int]], float],
           budget: float, table: KernelTable, layouts: dict[str, dict], log) -> Found:
    """From `levels` (each matmul's fastest), move groups to float activations until `cost(levels)` (the
    perplexity change against float) is within `budget`: each group measured alone once, then added in order
    of perplexity bought per table microsecond, every step measured; pathological groups only once every other
    group is moved and the budget still does not hold."""
    levels = dict(levels)
    change = cost(levels)
    found = Found(levels, change, [], [], [("table's fastest", change)])
    log(f"kernels: every matmul at its fastest kernel ({table.isa}): perplexity {change:+.2%} against float "
        f"(budget {budget:.0%})")
    if change <= budget:
        return found
    candidates = [g for g in groups if any(levels[n] != FLOAT for n in groups[g])]
    for pathological in (False, True):  # pathological kernels only when the others cannot meet the budget
        tried = [g for g in candidates if _pathological(table, g) == pathological]
        gains = {}
        for group in tried:
            alone = cost({**levels, **dict.fromkeys(groups[group], FLOAT)})
            gains[group] = found.change - alone
            log(f"kernels: {group} at float activations alone: {alone:+.2%}")
        order = sorted((g for g in tried if gains[g] > 0),
                       key=lambda g: -gains[g] / max(_extra_us(table, g, groups[g], layouts), 1e-3))
        for group in order:
            (found.forced if pathological else found.moved).append(group)
            levels.update(dict.fromkeys(groups[group], FLOAT))
            found.change = cost(levels)
            found.trail.append((f"+ {group} at float activations", found.change))
            log(f"kernels: + {group} at float activations: {found.change:+.2%}")
            if found.change <= budget:
                return found
    return found


def _windows(model_dir: Path, calibration: str | None, window: int) -> list[list[int]]:
    """WINDOWS windows spread over the calibration text (code, then prose)."""
    windows = calibration_sequences(model_dir, calibration, window)
    picks = np.linspace(0, len(windows) - 1, min(WINDOWS, len(windows))).round().astype(int)
    return [windows[i] for i in sorted(set(picks.tolist()))]


def _nll(logits: list[np.ndarray], sequences: list[list[int]]) -> float:
    """Mean negative log-likelihood of each window's tokens after its first."""
    total, count = 0.0, 0
    for row, ids in zip(logits, sequences):
        row = row[:-1].astype(np.float64)
        top = row.max(-1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(row - top).sum(-1))
        total += float((log_z - row[np.arange(len(ids) - 1), ids[1:]]).sum())
        count += len(ids) - 1
    return total / count


def _groups(matmuls: dict[str, dict]) -> dict[Group, list[str]]:
    groups: dict[Group, list[str]] = {}
    for name, choice in matmuls.items():
        groups.setdefault(Group(choice["kind"], choice["bits"], choice["block"]), []).append(name)
    return groups


def _pathological(table: KernelTable, group: Group) -> bool:
    return table.pathological(group.bits, group.block, FLOAT)


def _extra_us(table: KernelTable, group: Group, names: list[str], layouts: dict[str, dict]) -> float:
    """Table time the group adds at float activations, over its matmuls' N x K; 1 without figures."""
    weights = sum(layouts[name]["N"] * layouts[name]["K"] for name in names)
    per = [table.time_us(group.bits, group.block, level, weights) for level in (FLOAT, 4)]
    return 1.0 if None in per else per[0] - per[1]


def _write_levels(engine_dir: Path, levels: dict[str, int]) -> None:
    """Set each MatMulNBits node's accuracy_level from `levels` (weight name -> level) in model.onnx; the
    weights (external data) are not touched."""
    import onnx

    path = engine_dir / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        weight = node.input[1].removesuffix(".q") if node.op_type == "MatMulNBits" else None
        if weight in levels:
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = levels[weight]
    onnx.save(model, str(path))
