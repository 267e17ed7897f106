"""Summaries over repeated measurements: median with min and max, percentiles, the median of nested results."""
from __future__ import annotations

import statistics

import numpy as np

PERCENTILES = (50, 90, 99)


def spread(values: list[float]) -> dict[str, float]:
    """{median, min, max} of the runs of one measurement: the figure and how far the runs strayed."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def percentiles(values: list[float | None]) -> dict[str, float | None]:
    """p50/p90/p99 of the values that are not None (all None when none are)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {f"p{q}": None for q in PERCENTILES}
    return {f"p{q}": float(np.percentile(xs, q)) for q in PERCENTILES}


def median_of_runs(runs: list[dict]) -> dict:
    """The median of every number across runs (nested dicts alike); `runs` records how many."""
    return _median(runs) | {"runs": len(runs)}


def _median(items: list):
    first = items[0]
    if isinstance(first, dict):
        return {k: _median([it[k] for it in items]) for k in first}
    numbers = [x for x in items if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return statistics.median(numbers) if numbers else first
