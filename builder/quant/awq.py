"""AWQ (activation-aware weight quantization, Lin et al. 2023; AutoAWQ's `_search_best_scale`) in numpy.

For a linear y = x W^T with calibration inputs x, search per-input-channel scales
s = mean|x|^alpha / sqrt(max * min) over a grid of alpha in [0, 1) and keep the one whose quantized
layer, y' = (x / s) Q(W * s)^T, is closest to y in mean squared error. alpha = 0 is s = 1, plain
round-to-nearest, so the chosen scales never do worse than RTN on the calibration inputs. The 1/s is
folded into whatever produces x (a norm weight, the `up` rows of gate_up, the `v` rows of qkv)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from builder.quant.schemes import fake_quantize

GRID = 20


@dataclass(frozen=True)
class HeadTie:
    """The input is an attention output: channel (head h, dim d) comes from kv head h // group, so a
    scale folded into the v rows must be equal for all query heads of one kv head."""

    kv_heads: int
    heads: int
    head_dim: int

    def tie(self, stat: np.ndarray) -> np.ndarray:
        """Average a per-channel statistic [heads*head_dim] over each kv head's query heads."""
        grouped = stat.reshape(self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        return np.repeat(grouped.mean(1, keepdims=True), self.heads // self.kv_heads, axis=1).reshape(-1)

    def per_kv_channel(self, scale: np.ndarray) -> np.ndarray:
        """The tied scale [heads*head_dim] as one value per v channel [kv_heads*head_dim]."""
        return scale.reshape(self.kv_heads, self.heads // self.kv_heads, self.head_dim)[:, 0].reshape(-1)


@dataclass(frozen=True)
class AWQResult:
    scale: np.ndarray   # [K]
    alpha: float
    mse: float          # of the AWQ-quantized layer on the calibration inputs
    mse_rtn: float      # of plain round-to-nearest (alpha = 0)


def quantized_mse(x: np.ndarray, w: np.ndarray, scale: np.ndarray, bits: int, block: int,
                  symmetric: bool) -> float:
    """Mean squared output error of (x / s) Q(W * s)^T against x W^T; x [rows, K], W [N, K]."""
    effective = fake_quantize(w * scale[None, :], bits, block, symmetric) / scale[None, :]
    return float(np.mean((x @ (effective - w).T) ** 2))


def search_scales(x: np.ndarray, w: np.ndarray, bits: int, block: int, symmetric: bool = True,
                  tie: HeadTie | None = None, grid: int = GRID) -> AWQResult:
    """Grid-search AWQ scales for W [N, K] on calibration inputs x [rows, K]."""
    x = np.asarray(x, dtype=np.float32)
    stat = np.abs(x).mean(0)  # [K]
    if tie is not None:
        stat = tie.tie(stat)
    stat = np.maximum(stat, 1e-4)
    tried = []
    for step in range(grid):
        scale = stat ** (step / grid)
        scale = (scale / np.sqrt(scale.max() * scale.min())).astype(np.float32)  # step 0: all ones
        tried.append((quantized_mse(x, w, scale, bits, block, symmetric), step / grid, scale))
    mse, alpha, scale = min(tried, key=lambda t: t[0])  # ties keep the smaller alpha
    return AWQResult(scale, alpha, mse, tried[0][0])
