"""The weights a quantized engine really computes with, as Hugging Face parameters.

Verification of a quantized engine loads these into the transformers model (dequantized linears,
AWQ-scaled norms and rows) so that the lowering is checked against a reference that carries the same
quantization error; see builder/reference_check.py. Fused weights are split back into their
checkpoint tensors along their rows. Holds every changed tensor in memory at once (float32), which
verification, on by default only for models up to verify.auto_max_params, can afford."""
from __future__ import annotations

import numpy as np

from builder.ir import Graph
from builder.quant.experts import ExpertQuantizer
from builder.quant.weights import (ClippedWeight, PermutedColumns, QuantizedWeight, ScaledWeight, block_minimums,
                                   reference_holds, unpermute_columns)
from builder.quant.schemes import dequantize
from builder.weights import Concat, WeightSource


def effective_weights(graph: Graph) -> dict[str, np.ndarray]:
    """Checkpoint tensor (model parameter) name -> the float32 value the engine effectively uses, for
    every tensor the passes changed (quantized, scaled); untouched checkpoint tensors are left out."""
    out: dict[str, np.ndarray] = {}
    for source in graph.weights.values():
        if isinstance(source, QuantizedWeight) and source.part == "q":
            quant = source.quantizer
            if isinstance(quant, ExpertQuantizer):  # stacked experts (trace_moe.ExpertLayout)
                out[quant.source.param] = quant.source.to_parameter(quant.dequantized())
                continue
            if getattr(quant, "reference_loads", False) or reference_holds(quant.source):  # a GGUF file's own values
                continue
            value = dequantize(quant.arrays(), quant.bits, quant.block, quant.source.shape[1])
            mins = block_minimums(quant.source, quant.block)  # a GGUF type with a float minimum per block
            if mins is not None:
                value = value + np.repeat(mins, quant.block, axis=1)
            out.update(split_rows(quant.source, value))
        elif isinstance(source, (ScaledWeight, Concat)) and _changed(source):
            out.update(split_rows(source, source.materialize()))
    return out


def _changed(source: WeightSource) -> bool:
    if isinstance(source, ScaledWeight):
        return True
    return isinstance(source, Concat) and any(_changed(p) for p in source.parts)


def split_rows(source: WeightSource, value: np.ndarray) -> dict[str, np.ndarray]:
    """Cut a (possibly fused, scaled or column-permuted) weight's value back into its checkpoint tensors."""
    while isinstance(source, (ScaledWeight, PermutedColumns, ClippedWeight)):
        if isinstance(source, PermutedColumns):
            value = unpermute_columns(value, source.order)
        source = source.source
    if getattr(source, "key", None):  # a checkpoint tensor, or a Prequantized one standing for it
        return {source.key: value}
    if isinstance(source, Concat) and source.axis == 0:
        bounds = np.cumsum([p.shape[0] for p in source.parts])[:-1]
        pieces = np.split(value, bounds, axis=0)
        return {k: v for part, piece in zip(source.parts, pieces) for k, v in split_rows(part, piece).items()}
    raise ValueError(f"cannot map weight {source} back to checkpoint tensors")
