"""What each MatMulNBits kernel costs on this CPU: a table measured per instruction set (builder/data/
kernel_table.json, written by `python -m tools.bench.kernel_table`), microseconds per million weights for each
(bits, block, accuracy_level) at batch 1, timed at a model's own shapes streaming from memory.

On x86 ONNX Runtime has two kernel families: float activations (levels 0-3: 2 and 3 ask for fp16/bf16 compute,
which the x86 CPU provider runs as level 1) and int8 activations quantized on the fly (level 4). A choice whose
time is more than PATHOLOGICAL times the fastest for the same bits and block is never picked unless the accuracy
budget forces it (8-bit at level 0/1: 25-90x slower than level 4, ORT_NOTES.md). Without a table for this
instruction set the rule is the one measured on both: level 4 is the fastest, 8-bit below 4 pathological."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

TABLE_FILE = Path(__file__).parent.parent / "data" / "kernel_table.json"
FLOAT, INT8 = 1, 4  # the two kernel families on x86: float activations, int8 activations
PATHOLOGICAL = 4.0  # x the fastest choice of the same bits and block
NOTED_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's first `flags` line); empty where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_isa(flags: set[str]) -> str:
    """The instruction set whose MLAS kernels ONNX Runtime dispatches to: avx512 (AVX-512 F+BW; VNNI and AMX
    noted apart), avx2, or other."""
    if {"avx512f", "avx512bw"} <= flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "other"


@dataclass(frozen=True)
class KernelTable:
    """us per million weights at batch 1, by (bits, block, level), for one instruction set; `measured` says
    where the figures come from (empty: no table for this instruction set, the rule above applies)."""

    isa: str
    flags: tuple[str, ...] = ()
    times: dict[tuple[int, int, int], float] = field(default_factory=dict)
    measured: str = ""

    @classmethod
    def for_this_cpu(cls, table_file: Path = TABLE_FILE) -> KernelTable:
        flags = cpu_flags()
        return cls.load(cpu_isa(flags), tuple(sorted(flags & set(NOTED_FLAGS))), table_file)

    @classmethod
    def load(cls, isa: str, flags: tuple[str, ...] = (), table_file: Path = TABLE_FILE) -> KernelTable:
        entry = _read(table_file).get(isa)
        if not entry:
            return cls(isa, flags)
        times = {tuple(int(v) for v in key.split(":")): float(us) for key, us in entry["us_per_mweight"].items()}
        return cls(isa, flags, times, entry["measured"])

    def time_us(self, bits: int, block: int, level: int, weights: int) -> float | None:
        """Estimated batch-1 time of a matmul of `weights` weights; None where the table has no figure."""
        per = self._per_mweight(bits, block, _family(level))
        return None if per is None else per * weights / 1e6

    def pathological(self, bits: int, block: int, level: int) -> bool:
        """True when this choice is far slower than the fastest of the same bits and block."""
        mine, best = self._per_mweight(bits, block, _family(level)), self._best(bits, block)
        if mine is None or best is None:
            return bits == 8 and _family(level) == FLOAT
        return mine > PATHOLOGICAL * best

    def fastest(self, bits: int, block: int) -> int:
        """The faster kernel family's level for these bits and block (int8 activations without figures)."""
        times = {level: self._per_mweight(bits, block, level) for level in (FLOAT, INT8)}
        if None in times.values():
            return INT8
        return min(times, key=times.get)

    def describe(self, bits: int, block: int) -> str:
        """'level 4 12.3 us/Mweight, level 1 45.6 (3.7x)' for the manifest's why."""
        times = {level: self._per_mweight(bits, block, level) for level in (INT8, FLOAT)}
        if None in times.values():
            return f"no {self.isa} figure for {bits}-bit block {block}: level 4 by rule"
        return (f"{self.isa} level 4 {times[INT8]:.0f} us/Mweight, level 1 {times[FLOAT]:.0f} "
                f"({times[FLOAT] / times[INT8]:.1f}x)")

    def describe_block(self, bits: int, block: int, smaller: int) -> str:
        """'avx512 level 4 23 us/Mweight in blocks of 32, 32 in blocks of 16 (1.4x)' for the manifest's why."""
        times = [self._per_mweight(bits, b, INT8) for b in (block, smaller)]
        if None in times:
            return f"no {self.isa} figure for {bits}-bit level 4"
        return (f"{self.isa} level 4 {times[0]:.0f} us/Mweight in blocks of {block}, {times[1]:.0f} in blocks of "
                f"{smaller} ({times[1] / times[0]:.1f}x)")

    def _best(self, bits: int, block: int) -> float | None:
        times = [t for t in (self._per_mweight(bits, block, level) for level in (FLOAT, INT8)) if t is not None]
        return min(times, default=None)

    def _per_mweight(self, bits: int, block: int, level: int) -> float | None:
        """This block's figure, else the nearest measured block of the same bits and level."""
        blocks = sorted((b for bb, b, lv in self.times if bb == bits and lv == level), key=lambda b: abs(b - block))
        return self.times[(bits, blocks[0], level)] if blocks else None


def _family(level: int) -> int:
    return INT8 if level == INT8 else FLOAT


@cache
def _read(table_file: Path) -> dict:
    return json.loads(table_file.read_text()) if table_file.is_file() else {}
