"""GGUF's i-quants (IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) and ternary types
(TQ1_0, TQ2_0) carried exactly as 8-bit MatMulNBits (builder/gguf/repack.py), and `gguf.requantize: int4`.

- each type's repacked blocks dequantize to the `gguf` package's values bit for bit: random blocks with small
  scales, and every finite float16 d (subnormals, zero and negatives included) against random sub-block scales
  (max ulp difference 0: no float order of operations makes any value differ);
- engines from tiny files whose linears and embedding are i-quants match transformers loaded from the same file
  (logits within 3e-5 of the largest at accuracy_level 0, greedy identical), and the build log and manifest say
  the bytes;
- `gguf.requantize: int4` rounds exactly the i-quant tensors to int4 blocks of 32 (the file's other types stay
  its own integers), matches transformers running those weights, and is refused off a GGUF model or with a value
  it does not know."""
from __future__ import annotations

import json

import numpy as np
import pytest

from builder.gguf.checkpoint import GGUFCheckpoint, GGUFRequantized, GGUFWeight, stage_gguf
from builder.gguf.repack import BLOCK_TYPES, repack
from builder.quant.schemes import dequantize, quantize
from tests.builder.gguf_files import SCALE_FIELDS, random_blocks, set_iq1_m_scales, write_llama
from tests.builder.test_gguf import _against_transformers, _build, _gguf_dequantize

pytest.importorskip("gguf")
IQUANTS = [name for name, kind in BLOCK_TYPES.items() if kind.widened]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _ours(type_name: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    kind = BLOCK_TYPES[type_name]
    arrays, mins = repack(type_name, raw, rows, cols)
    assert mins is None and arrays.zero_points is None and kind.bits == 8  # (code - 128) * scale, nothing else
    return dequantize(arrays, kind.bits, kind.block, cols)


def _same_bits(ours: np.ndarray, expected: np.ndarray) -> bool:
    return np.array_equal(np.ascontiguousarray(ours, np.float32).view(np.uint32), expected.view(np.uint32))


def test_the_types_are_the_ones_llama_cpp_writes():
    assert IQUANTS == ["IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M",
                       "TQ1_0", "TQ2_0"]
    assert {BLOCK_TYPES[t].block for t in IQUANTS} == {16, 32, 256}


@pytest.mark.parametrize("type_name", IQUANTS)
def test_random_blocks_repack_bit_exactly(type_name):
    rng = np.random.default_rng(3)
    raw = random_blocks(type_name, 16, 1024, rng)
    assert _same_bits(_ours(type_name, raw, 16, 1024), _gguf_dequantize(raw, type_name))


@pytest.mark.parametrize("type_name", IQUANTS)
def test_every_float16_scale_repacks_bit_exactly(type_name):
    """One block per finite float16 d (63488 of them), the rest of each block random: gguf's float32 products
    (d * (0.5 + ls) * 0.25, then * grid * sign; IQ1's d * (2 ls + 1) * (grid +- 1/8)) equal ours exactly."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    d = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    d = d[np.isfinite(d)]
    values = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    raw = random_blocks(type_name, len(d), values, np.random.default_rng(4))
    if type_name == "IQ1_M":
        set_iq1_m_scales(raw, d)
    else:
        at = SCALE_FIELDS[type_name][0]
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    assert _same_bits(_ours(type_name, raw, len(d), values), _gguf_dequantize(raw, type_name))


IQUANT_CASES = [  # (linear types, tied): every i-quant and ternary type in a graph, an i-quant embedding both ways
    ({"q": "IQ4_NL", "k": "IQ4_XS", "v": "IQ3_XXS", "o": "IQ3_S", "gate": "IQ2_XXS", "up": "IQ2_XS", "down": "IQ2_S",
      "embed": "IQ4_XS"}, True),
    ({"q": "IQ1_S", "k": "IQ1_M", "v": "TQ1_0", "o": "TQ2_0", "gate": "IQ4_XS", "up": "IQ4_NL", "down": "IQ3_S",
      "embed": "IQ2_XS", "output": "IQ4_NL"}, False),
]


@pytest.mark.parametrize("types,tied", IQUANT_CASES)
def test_engine_matches_transformers_loaded_from_the_same_file(types, tied, tmp_path):
    path = write_llama(tmp_path / "m.gguf", types, hidden=256, inter=512, heads=4, kv_heads=2, tied=tied)
    logs: list[str] = []
    stage_gguf(path, log=logs.append)
    manifest = _build(path, tmp_path / "engine")
    record = manifest["quantization"]
    source = record["source"]
    assert source["tensor_types"]["model.layers.0.self_attn.q_proj.weight"] == types["q"]
    assert not record["skipped"], record["skipped"]  # every linear (and the head) in the file's own integers
    for name in set(types.values()):  # the bytes, said in the log and the manifest
        line = next(line for line in logs if f" {name} tensors " in line)
        assert f"8 bits a weight + a float scale per {BLOCK_TYPES[name].block}" in line
        assert f"against the file's {BLOCK_TYPES[name].file_bits():g}" in line
        assert source["carried"][name] in line
    error, agree = _against_transformers(tmp_path / "engine", path)
    assert error < 3e-5 and agree == 1.0, (error, agree)


REQUANTIZED = {"q": "IQ4_XS", "k": "Q4_K", "v": "IQ2_S", "o": "Q8_0", "gate": "IQ4_NL", "up": "IQ3_XXS",
               "down": "Q6_K", "embed": "IQ4_XS"}
HF_NAMES = {"embed": "model.embed_tokens.weight", "gate": "model.layers.0.mlp.gate_proj.weight",
            "up": "model.layers.0.mlp.up_proj.weight", "down": "model.layers.0.mlp.down_proj.weight",
            **{key: f"model.layers.0.self_attn.{key}_proj.weight" for key in ("q", "k", "v", "o")}}


def test_requantize_int4_rounds_only_the_i_quants(tmp_path):
    """The i-quant tensors become int4 RTN blocks of 32 of the file's exact values; the others keep the file's
    integers; the engine matches transformers running those weights (logits within 3e-5 of the largest, greedy
    identical; the build's own verification gives transformers the engine's weights, not the file's) and the
    manifest and log say what was rounded."""
    from builder.reference_check import compare, engine_logits, reference_logits

    path = write_llama(tmp_path / "m.gguf", REQUANTIZED, hidden=256, inter=512, heads=4, kv_heads=2, layers=1)
    logs: list[str] = []
    staged = stage_gguf(path, log=logs.append, requantize="int4")
    checkpoint, exact = GGUFCheckpoint(staged), GGUFCheckpoint(stage_gguf(path, log=lambda _: None))
    weights = {}
    for key, type_name in REQUANTIZED.items():
        source, own = checkpoint.source(HF_NAMES[key]), exact.source(HF_NAMES[key])
        if BLOCK_TYPES[type_name].widened:
            assert isinstance(source, GGUFRequantized) and (source.bits, source.block) == (4, 32), key
            weights[HF_NAMES[key]] = expected = dequantize(quantize(own.materialize(), 4, 32), 4, 32, own.k)
            assert _same_bits(source.materialize(), expected), key
        else:
            assert type(source) is GGUFWeight and _same_bits(source.materialize(), own.materialize()), key
    assert any("IQ4_XS tensors requantized to int4" in line and "lossy" in line for line in logs), logs

    manifest = _build(path, tmp_path / "engine", **{"gguf.requantize": "int4", "verify.enabled": "on",
                                                    "verify.tolerance": 1e9})  # sized below, to the logits
    source = manifest["quantization"]["source"]
    assert source["requantize"] == "int4" and "requantized to int4" in source["carried"]["IQ2_S"]
    assert manifest["quantization"]["quantized"]["layers.0.gate_up"]["block_size"] == 32  # IQ4_NL + IQ3_XXS
    assert manifest["verification"]["reference"] == "transformers with the engine's weights"
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 300, n).tolist() for n in (17, 9)]
    theirs = reference_logits(staged, sequences, weights)
    error, agree = compare(engine_logits(tmp_path / "engine", sequences), theirs)
    largest = max(float(np.abs(t).max()) for t in theirs)
    assert error / largest < 3e-5 and agree == 1.0, (error, largest, agree)


def test_requantize_is_refused_off_a_gguf_model_and_for_unknown_values(tmp_path):
    from builder.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"gguf.requantize: 'int3' is not allowed; allowed: \['none', 'int4'\]"):
        load_recipe(base={"model": "m.gguf"}, overrides=["gguf.requantize=int3"])
    with pytest.raises(Exception, match=r"gguf.requantize int4: model .* is not a GGUF file"):
        _build(tmp_path / "no_such_checkpoint_dir", tmp_path / "engine", **{"gguf.requantize": "int4"})
    assert not (tmp_path / "engine").exists()
