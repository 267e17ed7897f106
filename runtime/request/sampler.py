"""Next-token selection in numpy: greedy, or transformers-compatible warping + seeded sampling.

Warping order and semantics follow transformers' generate(): RepetitionPenaltyLogitsProcessor,
TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper (min_tokens_to_keep=1). Penalty and
temperature are computed in float32 like transformers; softmax, top-p cumulative sums and drawing in
float64.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtime.request.params import SamplingParams

_NEG_INF = np.float32(-np.inf)


def make_rng(seed: int | None) -> np.random.Generator:
    """The per-request generator: same seed -> same draws; None -> fresh OS entropy."""
    return np.random.default_rng(seed)


def apply_repetition_penalty(logits_row: np.ndarray, token_ids: np.ndarray | Sequence[int] | None,
                             penalty: float) -> np.ndarray:
    """transformers' RepetitionPenaltyLogitsProcessor on one row; returns a new array.

    Every distinct id in `token_ids` (prompt + generated) that is inside the vocabulary gets
    score * penalty when its score is < 0, else score / penalty. Ids outside [0, vocab) are ignored.
    """
    out = np.array(logits_row, copy=True)  # [vocab]
    if not np.issubdtype(out.dtype, np.floating):
        out = out.astype(np.float32)
    if penalty == 1.0 or token_ids is None:
        return out
    ids = np.unique(np.asarray(token_ids, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < out.shape[-1])]
    if ids.size:
        s = out[ids]
        pen = out.dtype.type(penalty)
        out[ids] = np.where(s < 0, s * pen, s / pen)
    return out


def _top_k_mask(x: np.ndarray, k: int) -> np.ndarray:
    """Mask of tokens to remove: score strictly below the k-th largest (ties are kept)."""
    k = min(max(k, 1), x.shape[-1])
    kth = np.partition(x, x.shape[-1] - k)[x.shape[-1] - k]
    return x < kth


def _softmax64(x: np.ndarray) -> np.ndarray:
    """Softmax in float64; -inf entries get exactly 0."""
    z = x.astype(np.float64)
    z = np.exp(z - z.max())
    return z / z.sum()


def _top_p_mask(x: np.ndarray, top_p: float) -> np.ndarray:
    """transformers' TopPLogitsWarper: sort ascending, remove tokens whose cumulative prob <= 1 - top_p,
    always keep the single most likely token. Ties are ordered so the lowest id wins like argmax."""
    order = np.argsort(-x, kind="stable")[::-1]  # [vocab] ascending; among ties the lowest id is last
    cum = np.cumsum(_softmax64(x[order]))
    remove_sorted = cum <= (1.0 - top_p)
    remove_sorted[-1] = False  # min_tokens_to_keep = 1
    remove = np.empty_like(remove_sorted)
    remove[order] = remove_sorted
    return remove


def warp_logits(logits_row: np.ndarray, params: SamplingParams,
                history: np.ndarray | Sequence[int] | None) -> np.ndarray:
    """Penalty, temperature, top-k, top-p on one row; removed tokens are -inf. float32 [vocab]."""
    x = np.asarray(logits_row, dtype=np.float32)  # [vocab]
    x = apply_repetition_penalty(x, history, params.repetition_penalty)
    if params.temperature not in (0.0, 1.0):
        x = x / np.float32(params.temperature)  # float32 like transformers
    if params.top_k > 0:
        x = np.where(_top_k_mask(x, params.top_k), _NEG_INF, x)
    if params.top_p < 1.0:
        x = np.where(_top_p_mask(x, params.top_p), _NEG_INF, x)
    return x


def probs_after_warping(logits_row: np.ndarray, params: SamplingParams,
                        history: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
    """The distribution the next token is drawn from, float64 [vocab] summing to 1.

    Greedy params give a one-hot vector at the (penalised) argmax, so speculative decoding can treat
    greedy and sampled requests alike."""
    if params.greedy:
        x = apply_repetition_penalty(np.asarray(logits_row, dtype=np.float32), history,
                                     params.repetition_penalty)
        p = np.zeros(x.shape[-1], dtype=np.float64)
        p[int(np.argmax(x))] = 1.0
        return p
    return _softmax64(warp_logits(logits_row, params, history))


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw of one index from a float64 distribution (zero-probability ids never drawn)."""
    cdf = np.cumsum(probs)  # [vocab]
    u = rng.random() * cdf[-1]
    idx = int(np.searchsorted(cdf, u, side="right"))
    if idx >= cdf.shape[0] or probs[idx] == 0.0:  # float edge: fall back to the last non-zero id
        idx = int(np.flatnonzero(probs)[-1])
    return idx


def sample(logits: np.ndarray, params: Sequence[SamplingParams],
           histories: Sequence[np.ndarray | Sequence[int] | None],
           rngs: Sequence[np.random.Generator | None]) -> np.ndarray:
    """Pick one token per row. logits [batch, vocab]; returns int64 [batch].

    Row i uses params[i], histories[i] (prompt + generated ids, for the repetition penalty) and
    rngs[i] (only consulted when params[i].temperature > 0). Greedy rows without a penalty are
    handled in one vectorised argmax (first max wins, like torch.argmax)."""
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"sample() expects logits of shape [batch, vocab], got {logits.shape}")
    batch = logits.shape[0]
    if not (len(params) == len(histories) == len(rngs) == batch):
        raise ValueError(f"sample(): batch {batch} but {len(params)} params, {len(histories)} histories, "
                         f"{len(rngs)} rngs")
    out = np.argmax(logits, axis=-1).astype(np.int64)  # [batch]
    for i, p in enumerate(params):
        if p.greedy:
            if p.repetition_penalty != 1.0:
                out[i] = int(np.argmax(apply_repetition_penalty(
                    logits[i].astype(np.float32), histories[i], p.repetition_penalty)))
            continue
        if rngs[i] is None:
            raise ValueError(f"sample(): row {i} samples (temperature={p.temperature}) but has no rng")
        out[i] = draw(probs_after_warping(logits[i], p, histories[i]), rngs[i])
    return out


def candidates_suffice(params: SamplingParams, k: int) -> bool:
    """Whether the graph's top-`k` candidates give exactly the draw full logits would: a sampled row
    whose top_k is applied first (1..k) and that needs no penalty nor log-probabilities over the whole vocabulary."""
    return not params.greedy and 1 <= params.top_k <= k and params.repetition_penalty == 1.0 and not params.full_logits


def sample_candidates(values: np.ndarray, ids: np.ndarray, params: SamplingParams,
                      rng: np.random.Generator) -> int:
    """Temperature / top-k / top-p and the seeded draw on one row's TopK candidates (values float32 [K],
    ids int64 [K]) instead of [vocab] logits. Put in id order, the candidates are the non-zero entries of
    the full-vocabulary distribution in the same order, so a seed draws the same token."""
    order = np.argsort(ids, kind="stable")
    return int(ids[order][draw(probs_after_warping(values[order], params), rng)])
