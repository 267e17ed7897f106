"""AWQ (activation-aware weight quantization, Lin et al. 2023; AutoAWQ's `_search_best_scale`) in numpy.

For a linear y = x W^T with calibration inputs x, search per-input-channel scales
s = mean|x|^alpha / sqrt(max * min) over a grid of alpha in [0, 1) and keep the one whose quantized
layer, y' = (x / s) Q(W * s)^T, is closest to y in mean squared error. alpha = 0 is s = 1, plain
round-to-nearest, so the chosen scales never do worse than RTN on the calibration inputs. The 1/s is
folded into whatever produces x (a norm weight, the `up` rows of gate_up, the `v` rows of qkv).

Then clipping (AutoAWQ's `auto_clip`): each block of each row is clamped to a fraction r of its largest
magnitude, r on a grid from 1 down to CLIP_LOWEST, the one that quantizes with the smallest output error on
the calibration inputs. The error of block g of row n is d X_g^T X_g d^T for the block's weight error d, so
one Gram matrix per block of columns, summed over every calibration row as transformers runs, scores every
row of W and every r.
r = 1 is plain round-to-nearest: clipping never does worse on the calibration inputs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from builder.quant.schemes import fake_quantize
from runtime.manifest.arith import ceil_div

GRID = 20
CLIP_GRID = 20
CLIP_LOWEST = 0.5
CLIP_ROWS = 4096  # rows searched at a time: bounds the temporaries to ~rows x K x 4 bytes each


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


@dataclass(frozen=True)
class ClipResult:
    bound: np.ndarray   # [N, blocks]: each block of each row clamped to [-bound, bound]
    error: float        # per output: the blocks' squared output errors summed, mean over rows and outputs
    error_rtn: float    # the same unclipped (r = 1)


def search_clip(gram: np.ndarray, w: np.ndarray, bits: int, block: int, symmetric: bool = True,
                grid: int = CLIP_GRID, lowest: float = CLIP_LOWEST, unclipped_rows: int = 0) -> ClipResult:
    """Per (row, block) clip bounds for W [N, K] that minimize the quantized output error on calibration inputs
    given by their block Gram matrices [blocks, block, block] (builder/quant/calibration.py block_gram, every
    row). The first `unclipped_rows` rows keep their whole range (query and key rows: an error there is
    amplified by the attention's softmax, which an output error does not see; AutoAWQ does not clip them)."""
    if gram.shape != (ceil_div(w.shape[1], block), block, block):
        raise ValueError(f"Gram {gram.shape} does not fit K {w.shape[1]} in blocks of {block}")
    gram = np.asarray(gram, np.float32)
    starts = [0] + list(range(unclipped_rows, len(w), CLIP_ROWS))
    parts = [_clip_rows(w[a:b], gram, bits, block, symmetric, 1 if a < unclipped_rows else grid, lowest)
             for a, b in zip(starts, starts[1:] + [len(w)]) if b > a]
    bound = np.concatenate([b for b, _, _ in parts])
    return ClipResult(bound, float(np.concatenate([e for _, e, _ in parts]).mean()),
                      float(np.concatenate([r for _, _, r in parts]).mean()))


def _clip_rows(w, gram, bits, block, symmetric, grid, lowest):
    """(bound [n, blocks], best error per row [n], unclipped error per row [n]) for rows W [n, K]."""
    n, k = w.shape
    pad = ((0, 0), (0, gram.shape[0] * block - k))
    wb = np.pad(w, pad).reshape(n, -1, block)
    absmax = np.abs(wb).max(-1)
    best_err, best = np.full(absmax.shape, np.inf, np.float32), absmax.copy()
    for step in range(grid):
        bound = absmax * np.float32(1 - step * (1 - lowest) / grid)  # step 0: r = 1, no clipping
        clipped = np.clip(wb, -bound[..., None], bound[..., None]).reshape(n, -1)[:, :k]
        d = np.pad(fake_quantize(clipped, bits, block, symmetric) - w, pad).reshape(n, -1, block).transpose(1, 0, 2)
        err = np.einsum("gnj,gnj->ng", d @ gram, d)  # d_g X_g^T X_g d_g^T per row and block, batched over blocks
        if step == 0:
            unclipped = err.sum(1)
        better = err < best_err
        best_err[better], best[better] = err[better], bound[better]
    return best, best_err.sum(1), unclipped
