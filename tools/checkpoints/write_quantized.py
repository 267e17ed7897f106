"""Pre-quantized checkpoints written from each format's published layout, for the import tests
(tests/builder/test_import_quantized.py) and the import benchmark:

    python -m tools.checkpoints.write_quantized SOURCE OUT --format gptq --bits 4 --group-size 128 [--asymmetric]
        [--act-order shared|each]

No producer runs in the tests (checked on PyPI 2026-11-24): gptqmodel 7.7.0 and autoawq 0.2.9 are
source-only; AutoAWQ requires triton, gptqmodel torch>=2.14.1 (2.13 here) and builds its kernels with
ninja. compressed-tensors 0.20.0 is pure Python and installs in seconds (with loguru and psutil), but
its producer llm-compressor was not tried and neither is a project dependency. So each format is
written from its specification, independently of the builder's readers (builder/quant/formats/):
- GPTQ: auto-gptq / gptqmodel `pack` (qweight int32 [K*bits/32, N], 32/bits codes per word along K,
  code j of a word at bits [bits*j, ...); qzeros the same along N, minus 1 in the v1 layout; scales
  float16 [groups, N]; g_idx int32 [K]). With desc_act (act-order) GPTQ quantizes the columns in a
  permuted order, group g being the columns at positions [g*group, (g+1)*group) of that order, and
  stores qweight in the original column order with g_idx[k] = the group of column k. GPTQ's order is
  the descending Hessian diagonal of the layer's input, which the format does not record; here it is a
  seeded random permutation, one per input (`shared`: q/k/v one, gate/up one, as GPTQ's come from the
  same input) or one per module (`each`).
- AWQ: AutoAWQ WQLinear_GEMM.from_linear (qweight int32 [K, N/8], nibble i of word j = column 8j +
  [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros [groups, N/8] the same way; scales float16 [groups, N]).
- compressed-tensors pack-quantized: compressed_tensors.compressors.pack_quantized (weight_packed int32
  [N, ceil(K*bits/32)] holding code + 2^(bits-1) at bit bits*i along K; weight_zero_point packed the
  same way along N; weight_scale [N, groups]; weight_shape [N, K]); the packing was checked once
  against compressed-tensors 0.20.0's pack_to_int32 (same words for 4 and 8 bits).
Codes come from a plain round-to-nearest of the float weights with float16 scales; `dequantized`
is W = (code - zero) * scale, the value every format's own dequantization gives."""
from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Codes:
    codes: np.ndarray   # uint8 [N, K]
    scales: np.ndarray  # float16 [N, groups]
    zeros: np.ndarray   # uint8 [N, groups]
    g_idx: np.ndarray   # int32 [K], the group of each column

    def dequantized(self) -> np.ndarray:
        scale = self.scales.astype(np.float32)[:, self.g_idx]
        return (self.codes.astype(np.float32) - self.zeros[:, self.g_idx].astype(np.float32)) * scale

    def permuted(self, order: np.ndarray) -> Codes:
        """Codes of W[:, order] as codes of W: column order[j] takes column j's code and group."""
        inverse = np.argsort(order)
        return Codes(self.codes[:, inverse], self.scales, self.zeros, self.g_idx[inverse])


def round_to_nearest(w: np.ndarray, bits: int, group: int, symmetric: bool) -> Codes:
    n, k = w.shape
    groups = -(-k // group)
    top, mid = 2**bits - 1, 2 ** (bits - 1)
    scales = np.zeros((n, groups), np.float16)
    zeros = np.full((n, groups), mid, np.uint8)
    codes = np.zeros((n, k), np.uint8)
    for g in range(groups):
        cols = w[:, g * group:(g + 1) * group]
        if symmetric:
            scale = (np.abs(cols).max(1) / (mid - 1)).astype(np.float16)
        else:
            low, high = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
            scale = ((high - low) / top).astype(np.float16)
            zeros[:, g] = np.clip(np.round(-low / np.maximum(scale.astype(np.float32), 1e-12)), 0, top)
        scales[:, g] = scale
        s = np.maximum(scale.astype(np.float32), 1e-12)[:, None]
        codes[:, g * group:(g + 1) * group] = np.clip(np.round(cols / s) + zeros[:, g:g + 1], 0, top)
    return Codes(codes, scales, zeros, (np.arange(k) // group).astype(np.int32))


def input_order(module: str, k: int, act_order: str) -> np.ndarray:
    """The seeded column order of `module`'s quantization (see the module docstring)."""
    layer, kind = module.rsplit(".", 1)
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    key = f"{layer}.{shared.get(kind, kind)}" if act_order == "shared" else module
    return np.random.default_rng(zlib.crc32(key.encode())).permutation(k)


def words(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words of 32/bits values along `axis` (a ragged end padded with zero codes)."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint64), axis, -1)
    pad = -v.shape[-1] % per
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (pad,), np.uint64)], -1).reshape(v.shape[:-1] + (-1, per))
    packed = (v << (np.arange(per, dtype=np.uint64) * bits)).sum(-1).astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(np.moveaxis(packed, -1, axis))


def gptq_tensors(c: Codes, bits: int, v2: bool) -> dict[str, np.ndarray]:
    zeros = c.zeros.astype(np.int64) - (0 if v2 else 1)
    return {"qweight": words(c.codes.T, bits, 0), "qzeros": words((zeros & (2**bits - 1)).T, bits, 1),
            "scales": np.ascontiguousarray(c.scales.T), "g_idx": c.g_idx}


def awq_tensors(c: Codes) -> dict[str, np.ndarray]:
    def interleave(values):  # [rows, N] -> nibble i of word j holds column 8j + AWQ_ORDER[i]
        rows, n = values.shape
        return values.reshape(rows, n // 8, 8)[:, :, AWQ_ORDER].reshape(rows, n)
    return {"qweight": words(interleave(c.codes.T), 4, 1), "qzeros": words(interleave(c.zeros.T), 4, 1),
            "scales": np.ascontiguousarray(c.scales.T)}


def compressed_tensors(c: Codes, bits: int, symmetric: bool) -> dict[str, np.ndarray]:
    out = {"weight_packed": words(c.codes, bits, 1), "weight_scale": c.scales.copy(),
           "weight_shape": np.array(c.codes.shape, np.int64)}
    if not symmetric:
        out["weight_zero_point"] = words(c.zeros, bits, 0)
    return out


CONFIGS = {
    "gptq": lambda bits, group, sym: {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                      "desc_act": False, "checkpoint_format": "gptq"},
    "gptq_v2": lambda bits, group, sym: {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                         "desc_act": False, "checkpoint_format": "gptq_v2"},
    "awq": lambda bits, group, sym: {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": not sym,
                                     "version": "gemm"},
    "compressed-tensors": lambda bits, group, sym: {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "format": "pack-quantized",
                                      "weights": {"num_bits": bits, "type": "int", "symmetric": sym,
                                                  "strategy": "group" if group > 0 else "channel",
                                                  "group_size": group if group > 0 else None, "actorder": None}}}},
}


def write_quantized(source: Path, out: Path, fmt: str, bits: int, group: int, symmetric: bool,
                    keep: bool = True, act_order: str | None = None) -> dict[str, np.ndarray]:
    """A copy of `source` with its decoder linears quantized in `fmt`, read and written one tensor at a
    time (bf16 float tensors stay bf16); returns the dequantized weights by checkpoint name when `keep`
    (group -1: one group per output channel). `act_order` (gptq only): None, "shared" or "each"."""
    if act_order and not fmt.startswith("gptq"):
        raise ValueError(f"act_order is a GPTQ (desc_act) layout, not one of {fmt}")
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    tensors, dequantized = {}, {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if not (name.endswith(".weight") and name.split(".")[-2] in LINEARS):
                tensors[name] = f.get_tensor(name)
                continue
            w = f.get_tensor(name).float().numpy()
            g = w.shape[1] if group == -1 else group
            module = name[:-len(".weight")]
            order = input_order(module, w.shape[1], act_order) if act_order else np.arange(w.shape[1])
            codes = round_to_nearest(w[:, order], bits, g, symmetric).permuted(order)
            parts = (gptq_tensors(codes, bits, fmt == "gptq_v2") if fmt.startswith("gptq") else
                     awq_tensors(codes) if fmt == "awq" else compressed_tensors(codes, bits, symmetric))
            tensors.update({f"{module}.{key}": torch.from_numpy(value) for key, value in parts.items()})
            if keep:
                dequantized[name] = codes.dequantized()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = CONFIGS[fmt](bits, group, symmetric)
    if act_order:
        config["quantization_config"]["desc_act"] = True
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


def write_float(source: Path, out: Path, weights: dict[str, np.ndarray]) -> None:
    """A float copy of `source` with `weights` replaced: the dequantized reference for transformers."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    # contiguous: safetensors.numpy writes an array's memory as it lies, whatever its strides
    tensors.update({name: np.ascontiguousarray(value, np.float32) for name, value in weights.items()})
    save_file(tensors, str(out / "model.safetensors"))


@click.command()
@click.argument("source", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(exists=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(sorted(CONFIGS)), default="gptq", show_default=True)
@click.option("--bits", type=click.Choice(["4", "8"]), default="4", show_default=True)
@click.option("--group-size", type=int, default=128, show_default=True, help="-1: one group per output channel")
@click.option("--asymmetric", is_flag=True, help="with zero points")
@click.option("--act-order", type=click.Choice(["shared", "each"]), default=None,
              help="gptq desc_act: a permuted g_idx, one order per input (shared) or per module (each)")
def main(source: Path, out: Path, fmt: str, bits: str, group_size: int, asymmetric: bool, act_order: str | None) -> None:
    """Write SOURCE's decoder linears round-to-nearest quantized in a pre-quantized checkpoint format."""
    write_quantized(source, out, fmt, int(bits), group_size, not asymmetric, keep=False, act_order=act_order)
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
