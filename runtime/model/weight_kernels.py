"""Which CUDA kernels run an engine's weight-only quantized matmuls (MatMulNBits).

onnxruntime-gpu carries two: its own (dequantize-then-GEMM, and a 4-bit GEMV) and TensorRT-LLM's CUTLASS
weight-only kernels, "fpA_intB" (a GEMM with a profiled tactic per M bucket and a GEMV decode kernel, 4 and 8
bits, float16 activations; bfloat16 in newer versions). The second is off by default in ONNX Runtime: the
environment variable ORT_FPA_INTB_GEMM turns it on (1.31), and from later versions the session config entry
`ep.cuda.fpa_intb_gemm` too (the entry wins over the environment). ONNX Runtime reads both when it creates each
MatMulNBits kernel, i.e. while a session is made, and takes the path only for the nodes it can run: blocks of
64 or 128 in the versions read so far (`block_size` 32 keeps ONNX Runtime's own kernel), N a multiple of 64
(int4) or 32 (int8), no g_idx.

The choice: the recipe's `target.weight_kernels` (recorded in the manifest), overridden at load by
`LoadConfig.weight_kernels`. "auto" follows `AUTO`, the choice measured on a lent GPU (docs/GPU.md), unless
ORT_FPA_INTB_GEMM is set in the environment, which is then obeyed. On CPU nothing is set: the CPU provider
has no such kernels."""
from __future__ import annotations

import os

from runtime.manifest.types import WEIGHT_KERNELS

ENV = "ORT_FPA_INTB_GEMM"
CONFIG = "ep.cuda.fpa_intb_gemm"
FPA_INTB_BLOCKS = (64, 128)  # MatMulNBits block sizes the fpA_intB path takes (onnxruntime 1.31's eligibility)
# What "auto" picks on CUDA. ONNX Runtime's own kernels until a lent GPU measures fpA_intB against them at the
# 1B and 7B shapes, batch 1 / 8 / 32 (tools/gpu/check.py, step "weight-kernels"): that step's table decides.
AUTO = "ort"


def configure(options, load: str | None, built: str, device: str) -> str:
    """Set up `options` (a session's, on `device`) for the load's choice (LoadConfig.weight_kernels), else the
    engine's (its manifest's target.weight_kernels); returns the kernels it runs, "ort" or "fpa_intb"."""
    kernels = resolve(load or built, device)
    apply(options, kernels, device)
    return kernels


def resolve(choice: str, device: str) -> str:
    """The kernels a session on `device` runs ("ort" or "fpa_intb") for the wanted `choice`."""
    if choice not in WEIGHT_KERNELS:
        raise ValueError(f"weight_kernels {choice!r} is not one of {WEIGHT_KERNELS}")
    if device != "cuda":
        return "ort"
    if choice != "auto":
        return choice
    if os.environ.get(ENV, "").strip() not in ("", "0", "off"):
        return "fpa_intb"
    return AUTO


def apply(options, kernels: str, device: str) -> None:
    """Make a CUDA session being set up with `options` (an onnxruntime.SessionOptions) run `kernels`: the
    session config entry for the ONNX Runtime versions that read it, and the environment variable for those
    that read only that (it is process-wide: every CUDA session this process makes later sets it again)."""
    if device != "cuda":
        return
    on = "1" if kernels == "fpa_intb" else "0"
    options.add_session_config_entry(CONFIG, on)
    os.environ[ENV] = on
