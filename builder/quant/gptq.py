"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers") in numpy, writing MatMulNBits' layout directly.

For a linear y = x W^T with calibration inputs x, H = 2 X^T X [K, K]. Columns of W [N, K] are quantized
one at a time, left to right in blocks of BLOCK columns; the rounding error of column j, divided by the
j-th diagonal of the upper Cholesky factor U of H^-1 (H^-1 = U^T U), is subtracted from the columns not
yet quantized along U's row j, which is the least-squares compensation of that error on the
calibration inputs. Dampening adds `damp` x mean(diag H) to the diagonal so H is invertible; a column
no input ever activated (zero diagonal) is quantized as zero.

Groups are the MatMulNBits blocks: contiguous `block` columns along K sharing one scale (and zero
point), computed the way schemes.quantize computes them (MLAS rounding) from the group's columns as
they stand when the group's first column is reached. Act-order (`act_order`) quantizes columns by
descending H diagonal, so the most activated columns are quantized while the most others can still
absorb their error. It uses "static groups": the scales come from the original contiguous groups
before any column is quantized, so the groups stay contiguous along K and the engine needs neither
MatMulNBits' g_idx input nor a permutation of its activations (the fast kernel; g_idx with arbitrary
column-to-group maps is what auto-gptq's true act-order writes, and it cannot be lowered to contiguous
blocks). Rows are independent, so a fused weight (q|k|v or gate|up, one shared input) is quantized
as one."""
from __future__ import annotations

import numpy as np

from builder.quant.schemes import QuantizedArrays, _asymmetric_range, _symmetric_range, pack
from runtime.manifest.arith import ceil_div

BLOCK = 128  # columns per lazy-update block (the paper's B); changes speed, never the result
ROWS = 4096  # rows solved at a time
DEFAULT_DAMP = 0.01


class Hessian:
    """Running H = 2 X^T X / rows over the calibration inputs of one linear (float32 sums, as
    reference GPTQ keeps them: float64 would double the K^2 x rows cost that dominates a large K)."""

    def __init__(self, k: int):
        self.sum = np.zeros((k, k), np.float32)
        self.rows = 0

    def add(self, x: np.ndarray) -> None:
        """x [..., K] inputs of the linear."""
        x = np.asarray(x, np.float32).reshape(-1, self.sum.shape[0])
        self.sum += x.T @ x
        self.rows += len(x)

    def value(self) -> np.ndarray:
        """H, scaled in place from the sums (no second K x K array): call it after the last add."""
        if self.rows:
            self.sum *= np.float32(2 / self.rows)
            self.rows = 0
        return self.sum


def gptq_quantize(w: np.ndarray, h: np.ndarray, bits: int, block: int, symmetric: bool = True,
                  damp: float = DEFAULT_DAMP, act_order: bool = False) -> QuantizedArrays:
    """Quantize W [N, K] with Hessian H [K, K] into MatMulNBits' layout (schemes.QuantizedArrays).
    H's dead diagonal entries are set to 1 in place. Rows are solved ROWS at a time (they are
    independent), so the working copy stays small next to a large W (a 128k-row lm_head)."""
    n, k = w.shape
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    u = _inverse_cholesky(h[np.ix_(order, order)] if act_order else h, damp)
    chunks = [_quantize_rows(w[i:i + ROWS], u, order, dead, bits, block, symmetric, act_order)
              for i in range(0, n, ROWS)]
    return QuantizedArrays(*(None if parts[0] is None else np.concatenate(parts) for parts in zip(*chunks)))


def _quantize_rows(w, u, order, dead, bits, block, symmetric, act_order) -> QuantizedArrays:
    w = np.array(w, np.float32)  # the working copy the error feedback updates
    n, k = w.shape
    w[:, dead] = 0
    groups = ceil_div(k, block)
    scales = np.zeros((n, groups), np.float32)
    zeros = np.zeros((n, groups), np.uint8)
    if act_order:  # static groups: every group's range from the original weights
        for g in range(groups):
            scales[:, g], zeros[:, g] = _group_range(w[:, g * block:(g + 1) * block], bits, symmetric)
    q = _solve(w[:, order] if act_order else w, u, order, block, bits, symmetric, scales, zeros, act_order)
    codes = np.zeros((n, groups * block), np.uint8)
    codes[:, order] = q
    packed = pack(codes.reshape(n, groups, block), bits)
    return QuantizedArrays(packed, scales, None if symmetric else pack(zeros, bits, pad=2 ** (bits - 1)))


def _inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """U, upper triangular, with U^T U = (H + damp * mean(diag H) I)^-1: Cholesky of H, the inverse
    from that factor, and its Cholesky again (torch: LAPACK potrf/potri, a third of inv's work), in
    float32 as reference GPTQ does, in float64 where float32 finds H not positive definite. H is
    dampened in place and restored, so that no second K x K copy is made."""
    import torch

    h = np.ascontiguousarray(h, np.float32)
    extra = damp * float(np.mean(np.diag(h)))
    for dtype in (torch.float32, torch.float64):
        m = torch.from_numpy(h).to(dtype)  # float32: shares h's memory
        m.diagonal().add_(extra)
        try:
            lower = torch.linalg.cholesky(m)
            inverse = torch.cholesky_inverse(lower)
            del lower
            return torch.linalg.cholesky(inverse, upper=True).to(torch.float32).numpy()
        except torch.linalg.LinAlgError:
            if dtype == torch.float64:
                raise
        finally:
            m.diagonal().sub_(extra)
    raise AssertionError("unreachable")


def _solve(w, u, order, block_group, bits, symmetric, scales, zeros, static):
    """Quantize the columns of w (already in quantization order) with error feedback; returns the
    codes [N, K] in that order. Fills `scales`/`zeros` [N, groups] unless `static`."""
    n, k = w.shape
    top = 2**bits - 1
    codes = np.zeros((n, k), np.uint8)
    for start in range(0, k, BLOCK):
        stop = min(start + BLOCK, k)
        errors = np.zeros((n, stop - start), np.float32)
        for j in range(start, stop):
            column = order[j]
            group = column // block_group
            if not static and column % block_group == 0:  # first column of a group: its range now
                span = w[:, j:j + block_group]  # in order == identity without act-order
                scales[:, group], zeros[:, group] = _group_range(span, bits, symmetric)
            scale, zero = scales[:, group], zeros[:, group].astype(np.float32)
            inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
            code = np.clip(np.floor(w[:, j] * inverse + zero + np.float32(0.5)), 0, top)
            codes[:, j] = code
            error = (w[:, j] - (code - zero) * scale) / u[j, j]
            w[:, j:stop] -= np.outer(error, u[j, j:stop])
            errors[:, j - start] = error
        w[:, stop:] -= errors @ u[start:stop, stop:]
    return codes


def _group_range(columns: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero point) [N] of one group, as schemes.quantize computes them."""
    scales, zp = (_symmetric_range if symmetric else _asymmetric_range)(columns[:, None, :], bits)
    return scales[:, 0], zp[:, 0]
