"""SolveGPTQ: GPTQ's integer weights for the linears QuantizeWeights will quantize (int4_gptq, int8_gptq).

Decoder layers are processed in order (builder/quant/layerwise.py): layer i runs on the calibration
text's hidden states as the already-quantized layers 0..i-1 leave them; H = 2 X^T X of each linear's
input is collected, each target weight is solved with GPTQ (builder/quant/gptq.py), and the layer's
modules get the dequantized weights before it runs again to produce layer i+1's inputs. A fused
weight (qkv, gate_up) is one target: its parts share one input, so one H, and GPTQ's rows are
independent. The lm_head, when quantized, is solved last on the final norm's outputs.

Each target's source becomes a `Prequantized` weight holding its MatMulNBits arrays (per checkpoint
tensor, inside the same Concat), which QuantizeWeights writes as they are: the same QuantLinear /
MatMulNBits lowering as round-to-nearest. graph.meta.gptq records the options and each target's
output error on the calibration inputs next to round-to-nearest's.

Memory: one float32 layer and one H per target (K x K float64, 512 MiB for K = 8192) at a time,
plus the integer results of the layers done (1/8 of the float weights at 4 bits)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from builder.ir import Graph
from builder.pass_manager import Pass
from builder.quant import (SEQ_LEN, CalibrationError, QuantOptions, QuantTarget, calibration_sequences,
                           checkpoint_key, plan_quantization)
from builder.quant.gptq import ROWS, Hessian, gptq_quantize
from builder.quant.layerwise import LayerwiseModel
from builder.quant.reference import split_rows
from builder.quant.schemes import QuantizedArrays, dequantize, fake_quantize
from builder.quant.weights import Prequantized
from builder.weights import CheckpointTensor, Concat, WeightSource


class SolveGPTQ(Pass):
    """GPTQ on the calibration text (quantization.calibration), with quantization.damp / act_order."""

    name = "solve_gptq"

    def __init__(self, model_dir: str | Path, options: QuantOptions):
        self.model_dir, self.options = Path(model_dir), options

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        mapping = plan_quantization(g, self.options)
        by_module = {_module(g.weights[name], name): target for name, target in mapping.targets.items()}
        model = LayerwiseModel(self.model_dir)
        seq_len = min(SEQ_LEN, g.meta.hyperparameters.get("max_position_embeddings") or SEQ_LEN)
        hidden = model.layer_inputs(calibration_sequences(self.model_dir, self.options.calibration, seq_len))
        record: dict[str, dict] = {}
        for index in range(len(model.layers)):
            hessians: dict[str, Hessian] = {}

            def observe(module: str, x: np.ndarray) -> None:
                if module in by_module:
                    hessians.setdefault(module, Hessian(x.shape[-1])).add(x)

            def update(prefix: str, layer) -> None:
                for module in sorted(m for m in hessians if m.startswith(prefix + ".")):
                    target = by_module.pop(module)
                    _write(layer, prefix, self._solve(g, target, hessians.pop(module), record, write=True))

            hidden = model.run_layer(index, hidden, observe, update)
        head = next((m for m in by_module if not m.startswith(model.prefix + ".")), None)
        if head is not None:  # the lm_head reads the final norm's output
            hessian = Hessian(g.weights[by_module[head].weight].shape[1])
            for x in model.final_hidden(hidden):
                hessian.add(x)
            self._solve(g, by_module.pop(head), hessian, record, write=False)
        if by_module:
            raise CalibrationError(f"int4/int8 GPTQ: no calibration inputs reached {sorted(by_module)}")
        g.meta.gptq = {"calibration": str(self.options.calibration or "builtin"), "damp": self.options.damp,
                          "act_order": self.options.act_order, "targets": record}
        return g

    def _solve(self, g: Graph, target: QuantTarget, hessian: Hessian, record: dict,
                write: bool) -> dict[str, np.ndarray]:
        """Solve one target; its source becomes Prequantized parts. Returns checkpoint key -> dequantized
        value when `write` (for the layer's modules), else nothing."""
        scheme, source = target.scheme, g.weights[target.weight]
        w, h = source.materialize(), hessian.value()
        arrays = gptq_quantize(w, h, scheme.bits, target.block, scheme.symmetric, self.options.damp,
                               self.options.act_order)
        g.weights[target.weight] = _prequantized(source, arrays, scheme.bits, target.block)
        record[target.weight] = _errors(w, h, arrays, target)
        return split_rows(source, dequantize(arrays, scheme.bits, target.block, target.k)) if write else {}


def _errors(w: np.ndarray, h: np.ndarray, arrays: QuantizedArrays, target: QuantTarget) -> dict:
    """GPTQ's and round-to-nearest's output error on the calibration inputs, in row chunks."""
    bits, block, symmetric = target.scheme.bits, target.block, target.scheme.symmetric
    gptq = rtn = 0.0
    for i in range(0, len(w), ROWS):
        rows = w[i:i + ROWS]
        part = QuantizedArrays(*(None if a is None else a[i:i + ROWS] for a in arrays))
        gptq += _output_error(h, dequantize(part, bits, block, target.k) - rows) * len(rows)
        rtn += _output_error(h, fake_quantize(rows, bits, block, symmetric) - rows) * len(rows)
    return {"error": gptq / len(w), "error_rtn": rtn / len(w)}


def _output_error(h: np.ndarray, delta: np.ndarray) -> float:
    """Mean squared output error on the calibration inputs, tr(D H D^T) / 2 / N for D = W' - W."""
    return float(np.einsum("nk,kl,nl->", delta, h, delta, optimize=True) / 2 / len(delta))


def _module(source: WeightSource, name: str) -> str:
    """The transformers module whose input is this weight's input (a fused weight's first part)."""
    key = checkpoint_key(source)
    if not _plain(source) or key is None or not key.endswith(".weight"):
        raise CalibrationError(f"GPTQ: weight {name} ({source}) is not a checkpoint Linear weight or a row-wise "
                               f"concatenation of them; GPTQ needs the module that reads it (use int4_rtn)")
    return key[:-len(".weight")]


def _plain(source: WeightSource) -> bool:
    if isinstance(source, Concat):
        return source.axis == 0 and all(_plain(p) for p in source.parts)
    return isinstance(source, CheckpointTensor)


def _prequantized(source: WeightSource, arrays: QuantizedArrays, bits: int, block: int) -> WeightSource:
    """`source`'s structure (checkpoint tensors joined by row) with each tensor's rows of `arrays`."""
    if isinstance(source, Concat):
        parts, start = [], 0
        for part in source.parts:
            rows = slice(start, start + part.shape[0])
            piece = QuantizedArrays(*(None if a is None else a[rows] for a in arrays))
            parts.append(_prequantized(part, piece, bits, block))
            start = rows.stop
        return Concat(parts, axis=0)
    n, k = source.shape
    return Prequantized(lambda: arrays, bits, block, n, k, arrays.zero_points is None, key=source.key, label="gptq")


def _write(layer, prefix: str, values: dict[str, np.ndarray]) -> None:
    """Load dequantized weights (checkpoint key -> [N, K]) into the layer's parameters."""
    import torch

    for key, value in values.items():
        param = layer.get_parameter(key[len(prefix) + 1:])
        param.data.copy_(torch.from_numpy(value))
