"""Integer arithmetic the builder and the runtime share (block counts of the KV layout, quantization blocks):
here, at the bottom of the runtime's layers, so that every package may use it."""
from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """The least integer >= a / b (b > 0): how many blocks of b hold a."""
    return -(-a // b)
