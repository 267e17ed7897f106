"""CalibrateKVScales: static per-channel scales for an int8 KV cache (recipe `kv_cache.dtype: int8`).

The calibration text (builder/quant/calibration.py) runs through transformers; per layer, K is measured
as attention reads it (after rotary) through the rotation-invariant envelope of each rotary pair, so the
scale bounds K at any position, and V by its largest |x| per channel. scale = extreme / 127, so codes
round(x / scale) of calibrated values stay within [-127, 127]. Each Attention node gains the inputs
k_scale, v_scale (float32 [kv_heads, 1, head_dim], per channel for both: ONNX Runtime's CPU kernel
requires k_quant_type == v_quant_type). The scales' range is recorded in graph.meta.kv_scales."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from builder.ir import Graph
from builder.pass_manager import Pass
from builder.quant.calibration import calibration_sequences
from builder.quant.layerwise import capture_kv_extremes
from builder.weights import ArrayWeight

INT8_MAX = 127
Extremes = list[tuple[np.ndarray, np.ndarray]]  # per layer: (k envelope, v |max|), each [kv_heads, head_dim]


class CalibrateKVScales(Pass):
    """Adds k_scale / v_scale weights to every Attention node of a graph whose KV plan stores int8.
    `capture(graph)` returns the per-layer extremes; the default runs transformers on `calibration`."""

    name = "calibrate_kv_scales"

    def __init__(self, model_dir: str | Path, calibration: str | None = None,
                 capture: Callable[[Graph], Extremes] | None = None):
        self.model_dir, self.calibration = Path(model_dir), calibration
        self.capture = capture or self._capture_with_transformers

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        if g.meta.kv_cache is None or g.meta.kv_cache.storage != "int8":
            raise ValueError("calibrate_kv_scales needs a KV plan with storage int8 (plan_kv_cache before it)")
        extremes = self.capture(g)
        for node in g.nodes_of("Attention"):
            layer = node.attrs["layer"]
            k_scale, v_scale = (_scale(x)[:, None, :] for x in extremes[layer])  # [kv_heads, 1, head_dim]
            node.inputs = (node.inputs + ["", "", ""])[:4] + [
                g.add_weight(f"layers.{layer}.kv_cache.k_scale", ArrayWeight(k_scale, "kv scale")),
                g.add_weight(f"layers.{layer}.kv_cache.v_scale", ArrayWeight(v_scale, "kv scale"))]
        return g

    def _capture_with_transformers(self, graph: Graph) -> Extremes:
        rope = graph.meta.rope
        rotary_dim = 0 if rope is None or rope.type == "none" else 2 * len(rope.inv_freq)
        sequences = calibration_sequences(self.model_dir, self.calibration)
        return capture_kv_extremes(self.model_dir, sequences, rotary_dim, rope is not None and rope.interleaved)


def _scale(extreme: np.ndarray) -> np.ndarray:
    """extreme / 127, floored so that a channel calibration never saw nonzero still has a usable scale."""
    floor = max(float(extreme.max()), 1e-6) * 1e-4
    return (np.maximum(extreme, floor) / INT8_MAX).astype(np.float32)
