"""Readers of pre-quantized checkpoint layouts, each turning one module's stored tensors into
MatMulNBits' arrays bit-exactly (builder/quant/schemes.py): gptq (gptqmodel / auto-gptq), awq
(AutoAWQ GEMM), compressed (compressed-tensors pack-quantized). builder/quant/imported.py picks one
from config.json's `quantization_config`."""
