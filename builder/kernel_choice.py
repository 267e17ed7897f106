"""Kernel choice by measurement (`quantization.accuracy_level: auto`): QuantizeWeights gave every matmul the
fastest kernel of its bits and block in this CPU's table (builder/quant/kernels.py); here, on the engine just
written, the build measures what that costs: perplexity on a few windows of the calibration text against
transformers running the engine's own weights in float (for a GGUF file: the file dequantized), and how often the
engine's top-1 token is float's. While perplexity is more than `quantization.accuracy_budget` above float (or, with
`quantization.accuracy_top1_budget`, top-1 agreement more than that below 1), the build takes steps (`search`),
every one measured. Two kinds of step: a layer kind's int8 activations to blocks of 16 (SMALL_BLOCK), its matmuls
stored in larger blocks re-blocked exactly (builder/quant/weights.py `reblock`; the engine written again through
the pipeline with `quantization.activation_block` for those kinds), tried first, a third of float activations'
table time per weight; then a group of matmuls (one layer kind at one bits and block) to float activations.
Perplexity and top-1 agreement need not move together: on SmolLM2's Q4_1 file o at float activations bought
perplexity and cost top-1 agreement (docs/ACCURACY.md, "Accuracy against llama.cpp on 8k tokens"). Pathological
kernels (8-bit at float activations: 25-90x slower) are tried only when no other step is left, and the record says
so. Levels change only model.onnx's `accuracy_level` attributes; blocks, the engine written again.

The calibration windows (6 x 256 tokens) resolve perplexity changes of a few tenths of a percent, not top-1
changes of a few thousandths: a top-1 budget of 0.027 on SmolLM2's files chased that noise (qkv and the head
re-blocked measured below qkv alone; on Q8_0 it moved groups toward float activations). The mean KL divergence of
the engine's next-token distribution from float's does resolve them: every position's whole distribution counts,
not one argmax. So `quantization.activation_block: auto` (the README recipe's) measures each layer kind's re-block
alone by KL, and a kind is worth its time when it removes a larger share of the int8 rounding's KL than the share
of the matmuls' table time it adds, clear of the noise (KL_Z paired standard errors; BlockTrial). Before the
budget's search those kinds are taken, the most worth first, each measured: all of them, or with
`quantization.accuracy_kl_budget` only until the engine's KL from float is within it (the fastest way in)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from builder.quant.calibration import calibration_sequences
from builder.quant.kernels import FLOAT, KernelTable
from builder.quant.levels import record_choices
from runtime.manifest.load import Manifest
from runtime.manifest.types import QuantizationRecord

WINDOWS, WINDOW = 6, 256  # ~1.5k tokens: a paired difference, so small changes show above the noise
SMALL_BLOCK = 16  # the activation block a re-block step offers (MatMulNBits' smallest)
KL_Z = 2.0  # activation_block auto: a re-block's KL reduction must stand this many standard errors clear of zero
CHUNK = 32  # scored positions per chunk for that standard error (neighbouring positions are not independent)


@dataclass(frozen=True)
class Group:
    """The matmuls of one layer kind at one bits and block: what moves to float activations together."""

    kind: str
    bits: int
    block: int

    def __str__(self) -> str:
        return f"{self.kind} ({self.bits}-bit, block {self.block})"


@dataclass(frozen=True)
class Accuracy:
    """One measurement against float: the relative perplexity change, the top-1 agreement, and the mean KL
    divergence of the engine's next-token distribution from float's (`kl_positions`: per scored position)."""

    change: float
    top1: float = 1.0
    kl: float = 0.0
    kl_positions: np.ndarray | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class BlockTrial:
    """`activation_block: auto`: one layer kind re-blocked alone, against the engine without it: the share of the
    int8 rounding's KL divergence it removes, that reduction in paired standard errors (over chunks of CHUNK
    positions), and the share of the matmuls' table time at batch 1 it adds."""

    kind: str
    kl_share: float
    z: float
    time_share: float

    @property
    def worth(self) -> bool:
        """Taken when it removes a larger share of the rounding than it adds of the time, clear of the noise."""
        return self.z >= KL_Z and self.kl_share >= self.time_share

    def __str__(self) -> str:
        return (f"{self.kind} in blocks of {SMALL_BLOCK}: KL {-self.kl_share:+.1%} (z {self.z:.1f}), matmul time "
                f"{self.time_share:+.1%} by the table")


@dataclass(frozen=True)
class Budget:
    """`perplexity`: the change allowed above float; `top1`: how far top-1 agreement may fall below 1; `kl`: the
    mean KL divergence from float allowed, nats a token (None: not a criterion)."""

    perplexity: float
    top1: float | None = None
    kl: float | None = None

    def holds(self, a: Accuracy) -> bool:
        return (a.change <= self.perplexity and (self.top1 is None or 1 - a.top1 <= self.top1)
                and (self.kl is None or a.kl <= self.kl))

    def excess(self, a: Accuracy) -> float:
        """The largest overshoot, each over its budget (what a step is ranked by buying)."""
        overs = [a.change / max(self.perplexity, 1e-6)]
        overs += [] if self.top1 is None else [(1 - a.top1) / max(self.top1, 1e-6)]
        overs += [] if self.kl is None else [a.kl / max(self.kl, 1e-9)]
        return max(overs)

    def __str__(self) -> str:
        return (f"{self.perplexity:.0%}" + ("" if self.top1 is None else f", top-1 agreement >= {1 - self.top1:.3f}")
                + ("" if self.kl is None else f", KL <= {self.kl:g}"))


def choose_kernels(engine_dir: Path, manifest: Manifest, model_dir: Path, budget: Budget, calibration: str | None,
                   reference: Callable[[list[list[int]]], list[np.ndarray]], log,
                   rewrite: Callable[[frozenset[str]], None] | None = None, auto_blocks: bool = False) -> Manifest:
    """The manifest with each matmul's measured choice; model.onnx's levels rewritten to match. `rewrite(kinds)`
    writes the engine again with those layer kinds' int8 activations in blocks of SMALL_BLOCK (None: no block
    steps); `auto_blocks` (`activation_block: auto`) tries every kind's re-block first (search)."""
    record = dict(manifest.quantization.record)
    record["quantized"] = dict(record["quantized"])
    matmuls = {name: dict(choice) for name, choice in record["matmuls"].items()}
    table = KernelTable.for_this_cpu()
    sequences = _windows(model_dir, calibration, min(WINDOW, manifest.limits.max_seq_len - 1))
    float_logprobs = [_logprobs(row) for row in reference(sequences)]
    nll_float = _nll(float_logprobs, sequences)
    float_logprobs = [lp.astype(np.float32) for lp in float_logprobs]  # kept for every measurement: half the bytes

    written = [frozenset()]  # the kinds re-blocked in the engine on disk

    def cost(levels: dict[str, int], kinds: frozenset[str] = frozenset()) -> Accuracy:
        _write(engine_dir, rewrite, written, kinds, levels)
        from builder.reference_check import engine_logits
        logprobs = [_logprobs(row) for row in engine_logits(engine_dir, sequences, "cpu", manifest)]
        kl = _kl(float_logprobs, logprobs)
        return Accuracy(float(np.exp(_nll(logprobs, sequences) - nll_float) - 1), _top1(logprobs, float_logprobs),
                        float(kl.mean()), kl)

    levels = {name: choice["level"] for name, choice in matmuls.items()}
    fixed = frozenset(choice["kind"] for choice in matmuls.values() if "activation_block" in choice)  # the recipe's
    found = search(_groups(matmuls), levels, cost, budget, table, record["quantized"], log, blocks=rewrite is not None,
                   fixed=fixed, auto_blocks=auto_blocks and rewrite is not None)
    trials = {t.kind: t for t in found.trials}
    levels, change, moved, forced, trail = found.levels, found.accuracy.change, found.moved, found.forced, found.trail
    _write(engine_dir, rewrite, written, found.reblocked, levels)
    for name, choice in matmuls.items():
        choice["level"] = levels[name]
        group = Group(choice["kind"], choice["bits"], choice["block"])
        if group in forced:
            choice["why"] = (f"float activations forced by the budget although pathological here "
                             f"({table.describe(group.bits, group.block)})")
        elif group in moved:
            choice["why"] = f"float activations for accuracy ({table.describe(group.bits, group.block)})"
        if name in found.blocks:
            choice["activation_block"] = found.blocks[name]
            record["quantized"][name] = dict(record["quantized"][name], block_size=found.blocks[name],
                                             stored_block=group.block)
            if group not in moved and group not in forced and group.kind in trials and trials[group.kind].worth:
                choice["why"] = f"int8 activations by activation_block auto: {trials[group.kind]}"
            elif group not in moved and group not in forced:
                choice["why"] = (f"int8 activations in blocks of {found.blocks[name]} for accuracy "
                                 f"({table.describe_block(group.bits, group.block, found.blocks[name])})")
    within = budget.holds(found.accuracy)
    if not within:
        log(f"kernels: perplexity {change:+.2%}, top-1 agreement {found.accuracy.top1:.4f}: still outside the budget "
            f"{budget} with every useful group at float activations; kept")
    record.update(record_choices(matmuls, record.get("accuracy_level", 4),
                                 {"experts"} if "experts" in record.get("accuracy_levels", {}) else set()))
    record["kernel_choice"] = {
        "isa": table.isa, "cpu_flags": list(table.flags), "table": table.measured or "none for this ISA: rule",
        "budget": budget.perplexity, "top1_budget": budget.top1, "windows": len(sequences),
        "window": len(sequences[0]), "perplexity_change": change, "top1_agreement": found.accuracy.top1,
        "kl": found.accuracy.kl, "within_budget": within,
        "steps": [{"step": step, "perplexity_change": a.change, "top1_agreement": a.top1, "kl": a.kl}
                  for step, a in trail],
        "activation_block_trials": [{"kind": t.kind, "kl_share": t.kl_share, "z": t.z, "time_share": t.time_share,
                                     "taken": t.kind in found.reblocked} for t in found.trials],
        "forced_pathological": [str(g) for g in forced],
        "activation_block": {kind: SMALL_BLOCK for kind in sorted(found.reblocked)}}
    return manifest.replace(quantization=QuantizationRecord(manifest.quantization.mode, record))


@dataclass
class Found:
    """What search found: each matmul's level, the accuracy measured last, the groups moved to float
    activations (`forced`: pathological ones), the layer kinds whose int8 activations run in blocks of SMALL_BLOCK
    (`reblocked`; `blocks`: each re-blocked matmul's new block), each measured step, and `activation_block: auto`'s
    trials."""

    levels: dict[str, int]
    accuracy: Accuracy
    moved: list[Group]
    forced: list[Group]
    trail: list[tuple[str, Accuracy]]
    reblocked: frozenset[str] = frozenset()
    blocks: dict[str, int] = field(default_factory=dict)
    trials: list[BlockTrial] = field(default_factory=list)


@dataclass(frozen=True)
class Step:
    """One move the search can make: `group` to float activations, or (`block` set) the int8 activations of every
    matmul of `group.kind` stored in blocks `block` divides to blocks of `block`."""

    group: Group
    block: int | None = None

    def __str__(self) -> str:
        if self.block is None:
            return f"{self.group} at float activations"
        return f"{self.group.kind} at int8 activations in blocks of {self.block}"


def search(groups: dict[Group, list[str]], levels: dict[str, int],
           cost: Callable[[dict[str, int], frozenset[str]], Accuracy], budget: Budget, table: KernelTable,
           layouts: dict[str, dict], log, blocks: bool = True, fixed: frozenset[str] = frozenset(),
           auto_blocks: bool = False) -> Found:
    """From `levels` (each matmul's fastest), take steps until `cost(levels, reblocked kinds)` (accuracy against
    float) holds `budget`, in three phases: kinds to smaller int8 blocks (`blocks` False: none; never the `fixed`
    kinds, which the recipe's `quantization.activation_block` re-blocked already), groups to float
    activations, pathological groups to float activations. In each phase every step is measured alone once (from
    where the phases before left it), then taken in order of overshoot bought (`Budget.excess`) per table
    microsecond, every step measured. Re-blocks first: they cost a third of float activations' table time per
    weight, and steps measured alone do not add up; on SmolLM2's Q4_1 calibration windows qkv at float
    activations ranked above the head's re-block by what each bought alone, while on 8k tokens of prose qkv and the
    head re-blocked bought more agreement (0.9710 against 0.9699) for half the decode time (docs/ACCURACY.md)."""
    levels = dict(levels)
    first = cost(levels, frozenset())
    found = Found(levels, first, [], [], [("table's fastest", first)])
    log(f"kernels: every matmul at its fastest kernel ({table.isa}): perplexity {first.change:+.2%} against float, "
        f"top-1 agreement {first.top1:.4f} (budget {budget})")
    if auto_blocks and not (budget.kl is not None and budget.holds(first)):
        found.trials = _block_trials(groups, levels, cost, first, table, layouts, fixed, log)
        for trial in sorted((t for t in found.trials if t.worth), key=lambda t: -t.kl_share / max(t.time_share, 1e-9)):
            found.reblocked = found.reblocked | {trial.kind}
            found.accuracy = cost(levels, found.reblocked)
            found.trail.append((f"+ {trial.kind} in blocks of {SMALL_BLOCK} (activation_block auto)", found.accuracy))
            log(f"kernels: + {trial.kind} in blocks of {SMALL_BLOCK}: perplexity {found.accuracy.change:+.2%}, "
                f"top-1 {found.accuracy.top1:.4f}, KL {found.accuracy.kl:.5f} (from {first.kl:.5f})")
            if budget.kl is not None and budget.holds(found.accuracy):
                break  # the fastest way into the budget: the rest are not needed
        fixed = fixed | found.reblocked
    if budget.holds(found.accuracy):
        found.blocks = _blocks(groups, found.reblocked)
        return found
    candidates = [g for g in groups if any(levels[n] != FLOAT for n in groups[g])]
    phases = ([_block_steps(groups, levels, fixed)] if blocks else []) + [
        [Step(g) for g in candidates if not _pathological(table, g)],
        [Step(g) for g in candidates if _pathological(table, g)]]  # pathological kernels only when all else fails
    for phase, steps in enumerate(phases):
        gains, times = {}, {}
        for step in steps:
            alone = cost(*_apply(step, groups, dict(levels), found.reblocked))
            gains[step] = budget.excess(found.accuracy) - budget.excess(alone)
            times[step] = _step_us(table, step, groups, levels, layouts)
            log(f"kernels: {step} alone: {alone.change:+.2%}, top-1 {alone.top1:.4f}, "
                f"+{times[step]:.0f} us at batch 1 by the table")
        for step in sorted((s for s in steps if gains[s] > 0), key=lambda s: -gains[s] / max(times[s], 1e-3)):
            if step.block is None:
                (found.forced if phase == len(phases) - 1 else found.moved).append(step.group)
            levels, found.reblocked = _apply(step, groups, levels, found.reblocked)
            found.accuracy = cost(levels, found.reblocked)
            found.trail.append((f"+ {step}", found.accuracy))
            log(f"kernels: + {step}: {found.accuracy.change:+.2%}, top-1 {found.accuracy.top1:.4f}")
            if budget.holds(found.accuracy):
                break
        if budget.holds(found.accuracy):
            break
    found.levels = levels
    found.blocks = _blocks(groups, found.reblocked)
    return found


def _blocks(groups: dict[Group, list[str]], kinds: frozenset[str]) -> dict[str, int]:
    return {n: SMALL_BLOCK for g in groups if g.kind in kinds and _reblockable(g) for n in groups[g]}


def _block_trials(groups: dict[Group, list[str]], levels: dict[str, int],
                  cost: Callable[[dict[str, int], frozenset[str]], Accuracy], base: Accuracy, table: KernelTable,
                  layouts: dict[str, dict], fixed: frozenset[str], log) -> list[BlockTrial]:
    """`activation_block: auto`: each layer kind's re-block measured alone against `base`, its KL reduction as a
    share of the int8 rounding's KL and its time as a share of the matmuls' table time. KL, not perplexity or top-1:
    every position's whole distribution counts, so 1.5k positions resolve a few percent of the rounding (on
    SmolLM2's Q4_1 file the calibration windows' shares matched 8k tokens of prose within 1.5 points per kind,
    docs/ACCURACY.md). Without a table for this CPU the time cannot be priced and nothing is tried."""
    if not table.measured:
        log(f"kernels: activation_block auto: no kernel table for {table.isa} to price a re-block (`python -m "
            f"tools.bench.kernel_table` measures one); nothing re-blocked")
        return []
    total = sum(_table_us(table, g, levels, names, layouts) for g, names in groups.items())
    trials = []
    for step in _block_steps(groups, levels, fixed):
        alone = cost(levels, frozenset({step.group.kind}))
        share, z = _kl_gain(base, alone)
        trials.append(BlockTrial(step.group.kind, share, z, _step_us(table, step, groups, levels, layouts) / total))
        log(f"kernels: activation_block auto: {trials[-1]}: {'' if trials[-1].worth else 'not '}worth it")
    return trials


def _table_us(table: KernelTable, group: Group, levels: dict[str, int], names: list[str],
              layouts: dict[str, dict]) -> float:
    """Table time of `names` (of `group`) at their levels; 0 without figures."""
    times = [table.time_us(group.bits, group.block, levels[n], layouts[n]["N"] * layouts[n]["K"]) for n in names]
    return sum(t for t in times if t is not None)


def _kl_gain(base: Accuracy, after: Accuracy) -> tuple[float, float]:
    """(the share of `base`'s mean KL that `after` removes, that reduction over its standard error from the paired
    differences of chunks of CHUNK positions)."""
    diff = base.kl_positions - after.kl_positions
    chunks = np.array([c.mean() for c in np.array_split(diff, max(1, len(diff) // CHUNK))])
    se = chunks.std(ddof=1) / np.sqrt(len(chunks)) if len(chunks) > 1 else np.inf
    share = float(diff.mean() / base.kl) if base.kl > 0 else 0.0
    return share, float(diff.mean() / se) if se > 0 else (np.inf if diff.mean() > 0 else 0.0)


def _apply(step: Step, groups: dict[Group, list[str]], levels: dict[str, int],
           reblocked: frozenset[str]) -> tuple[dict[str, int], frozenset[str]]:
    """(levels, re-blocked kinds) after `step`."""
    if step.block is not None:
        return levels, reblocked | {step.group.kind}
    levels.update(dict.fromkeys(groups[step.group], FLOAT))
    return levels, reblocked


def _block_steps(groups: dict[Group, list[str]], levels: dict[str, int], fixed: frozenset[str]) -> list[Step]:
    """One re-block step per layer kind (not `fixed`) with matmuls at int8 activations stored in blocks
    SMALL_BLOCK divides (named by its first such group)."""
    steps = {}
    for g, names in groups.items():
        if g.kind not in fixed and _reblockable(g) and any(levels[n] != FLOAT for n in names):
            steps.setdefault(g.kind, Step(g, SMALL_BLOCK))
    return list(steps.values())


def _reblockable(group: Group) -> bool:
    return group.block > SMALL_BLOCK and group.block % SMALL_BLOCK == 0 and SMALL_BLOCK * group.bits % 8 == 0


def _windows(model_dir: Path, calibration: str | None, window: int) -> list[list[int]]:
    """WINDOWS windows spread over the calibration text (code, then prose)."""
    windows = calibration_sequences(model_dir, calibration, window)
    picks = np.linspace(0, len(windows) - 1, min(WINDOWS, len(windows))).round().astype(int)
    return [windows[i] for i in sorted(set(picks.tolist()))]


def _logprobs(logits: np.ndarray) -> np.ndarray:
    """log-softmax in float64 at a window's scored positions (all but its last: nothing follows it)."""
    x = logits[:-1].astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _nll(logprobs: list[np.ndarray], sequences: list[list[int]]) -> float:
    """Mean negative log-likelihood of each window's tokens after its first."""
    total = sum(float(lp[np.arange(len(ids) - 1), ids[1:]].sum()) for lp, ids in zip(logprobs, sequences))
    return -total / sum(len(lp) for lp in logprobs)


def _kl(reference: list[np.ndarray], logprobs: list[np.ndarray]) -> np.ndarray:
    """KL(float || engine) in nats at each scored position, in order."""
    return np.concatenate([(np.exp(ref) * (ref - lp)).sum(-1) for ref, lp in zip(reference, logprobs)])


def _top1(logprobs: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """The share of scored positions whose argmax is the reference's."""
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logprobs, reference))
    return same / sum(len(a) for a in logprobs)


def _groups(matmuls: dict[str, dict]) -> dict[Group, list[str]]:
    groups: dict[Group, list[str]] = {}
    for name, choice in matmuls.items():
        groups.setdefault(Group(choice["kind"], choice["bits"], choice["block"]), []).append(name)
    return groups


def _pathological(table: KernelTable, group: Group) -> bool:
    return table.pathological(group.bits, group.block, FLOAT)


def _step_us(table: KernelTable, step: Step, groups: dict[Group, list[str]], levels: dict[str, int],
             layouts: dict[str, dict]) -> float:
    """Table time a step adds at batch 1 over its matmuls' N x K (a re-block: every re-blockable group of the kind
    still at int8 activations); 1 without figures."""
    if step.block is None:
        return _extra_us(table, step.group, step.group.block, FLOAT, groups[step.group], layouts)
    return sum(_extra_us(table, g, step.block, 4, [n for n in names if levels[n] != FLOAT], layouts)
               for g, names in groups.items() if g.kind == step.group.kind and _reblockable(g))


def _extra_us(table: KernelTable, group: Group, block: int, level: int, names: list[str],
              layouts: dict[str, dict]) -> float:
    """Table time `names` (of `group`, at int8 activations now) add at `block` and `level`; 1 without figures."""
    weights = sum(layouts[name]["N"] * layouts[name]["K"] for name in names)
    per = [table.time_us(group.bits, b, lv, weights) for b, lv in ((block, level), (group.block, 4))]
    return 1.0 if None in per else per[0] - per[1]


def _write(engine_dir: Path, rewrite: Callable[[frozenset[str]], None] | None, written: list[frozenset[str]],
           kinds: frozenset[str], levels: dict[str, int]) -> None:
    """The engine on disk with `kinds` re-blocked (written again only when that changes) and `levels`."""
    if kinds != written[0]:
        rewrite(kinds)
        written[0] = kinds
    _write_levels(engine_dir, levels)


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
