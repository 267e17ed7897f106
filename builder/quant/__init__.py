"""Weight-only quantization to ONNX Runtime's MatMulNBits: the entry point for passes, the build and tools.

    schemes      the scheme registry (SCHEMES, scheme_for) and the numpy quantizer (quantize, dequantize,
                 fake_quantize) in MatMulNBits layout
    weights      lazy weight sources: a weight quantized part by part (QuantizedWeight), an AWQ-scaled or clipped one,
                 one given by its quantized arrays (Prequantized)
    plan         which Linear weights a build quantizes, with which layout, and why the others are skipped
    reference    the weights a quantized engine really computes with (for the transformers reference check)
    awq          AWQ's per-channel scale search
    gptq         GPTQ's column-by-column solve with error feedback (Hessian of calibration inputs)
    layerwise    a transformers decoder run one layer at a time (GPTQ's sequential calibration, AWQ's captures)
    calibration  the calibration text, AWQ's captured inputs' shape, int8 KV's extremes (runs transformers)

Nothing here imports the recipe: options arrive as any object of the QuantOptions shape."""
from builder.quant.awq import HeadTie, search_scales
from builder.quant.calibration import SEQ_LEN, CalibrationError, calibration_sequences
from builder.quant.layerwise import capture_inputs
from builder.quant.plan import QuantizeMapping, QuantTarget, plan_quantization
from builder.quant.reference import effective_weights
from builder.quant.schemes import (DEFAULT_ACCURACY_LEVEL, INT8_BLOCK, SCHEMES, QuantOptions, QuantScheme, dequantize,
                                   fake_quantize, quantize, scheme_for)
from builder.quant.weights import ClippedWeight, Quantizer, QuantizedWeight, ScaledWeight, checkpoint_key

__all__ = ["DEFAULT_ACCURACY_LEVEL", "INT8_BLOCK", "SCHEMES", "SEQ_LEN", "CalibrationError", "ClippedWeight", "HeadTie",
           "QuantOptions", "QuantScheme", "QuantTarget", "QuantizeMapping", "QuantizedWeight", "Quantizer", "ScaledWeight",
           "calibration_sequences", "capture_inputs", "checkpoint_key", "dequantize", "effective_weights",
           "fake_quantize", "plan_quantization", "quantize", "scheme_for", "search_scales"]
