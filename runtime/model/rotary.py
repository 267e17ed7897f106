"""The rotary tables bound to an engine's cos_cache / sin_cache inputs, computed as transformers does."""
from __future__ import annotations

import numpy as np

from runtime.manifest.types import Rope, from_json


def rope_tables(rope: Rope | dict, length: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches [length, head_dim/2] the way transformers computes them in float32. `rope`: the
    manifest's typed section, or its JSON form."""
    if isinstance(rope, dict):
        rope = from_json(Rope, rope, "rope")
    inv_freq = np.asarray(rope.inv_freq, dtype=np.float32)
    freqs = np.outer(np.arange(length, dtype=np.float32), inv_freq).astype(np.float32)
    scale = np.float32(rope.attention_scaling)
    cos, sin = np.cos(freqs) * scale, np.sin(freqs) * scale
    if dtype == "bfloat16":  # numpy has no bfloat16: the bits, bound with ONNX element type 16
        return bfloat16_bits(cos), bfloat16_bits(sin)
    return cos.astype(dtype), sin.astype(dtype)


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even like torch's conversion."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
