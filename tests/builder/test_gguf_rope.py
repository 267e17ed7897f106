"""Rope scaling read from GGUF files: llama.cpp's rope_freqs.weight (Llama 3.x's llama3 scaling, as per-dimension
frequency factors) and the `rope.scaling.*` metadata (linear, yarn); what is not read is refused by name before
any work (builder/gguf/arch.py rope_scaling).

Positions run to ~90 with a rotary head of 32 (base 10000: wavelengths 6 to 35000), so the scaled low
frequencies turn by whole radians there; each test also checks that dropping the scaling moves the logits."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from builder.gguf.checkpoint import stage_gguf
from builder.gguf.reader import GGUFError, open_gguf
from tests.builder.gguf_files import write_llama

pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[2]
LENGTHS = (90, 41)
NEW_TOKENS = 8
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 3.0,
          "original_max_position_embeddings": 100}  # not Llama 3.x's (1, 4, 8192): recovered by solving


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _build(model: Path, out: Path) -> Path:
    from builder.build import build_engine
    from builder.recipe import load_recipe

    overrides = ["limits.max_seq_len=128", "limits.max_batch_size=2", "quantization.accuracy_level=0",
                 "verify.enabled=off"]
    return build_engine(load_recipe(base={"model": str(model)}, overrides=overrides), out, log=lambda _: None)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(4, vocab, n).tolist() for n in LENGTHS]


def _check_engine(engine: Path, reference, unscaled, prompts: list[list[int]]) -> None:
    """The engine's logits at every position within 1e-4 of `reference`'s (relative to the largest |logit| where
    that exceeds 1: Gemma's run to ~100), its greedy tokens identical; and
    `unscaled` (the reference without rope scaling) differing, so the scaling is what is being checked."""
    import torch

    from builder.reference_check import compare, engine_logits
    from runtime.engine import LLM
    from runtime.request.params import SamplingParams

    with torch.no_grad():
        theirs = [reference(torch.tensor([p])).logits[0].numpy() for p in prompts]
        plain = [unscaled(torch.tensor([p])).logits[0].numpy() for p in prompts]
        greedy = [_greedy(reference, p, NEW_TOKENS) for p in prompts]
    largest = max(1.0, max(float(np.abs(t).max()) for t in theirs))
    error, agree = compare(engine_logits(engine, prompts), theirs)
    moved, _ = compare(plain, theirs)
    assert error / largest < 1e-4 and agree == 1.0, (error, largest, agree)
    assert moved > 1000 * error and moved > 1e-2, (moved, error)
    llm = LLM(engine)
    try:
        results = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        llm.close()
    assert [r.token_ids for r in results] == greedy


def _greedy(model, prompt: list[int], count: int) -> list[int]:
    import torch

    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


# -- rope_freqs.weight: a file made by llama.cpp's converter ----------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    """(tiny HF checkpoint with a llama3 rope_scaling, the GGUF llama.cpp's convert_hf_to_gguf.py makes of it).
    The converter comes from the llama-cpp-python sdist on the package index (tools/checkpoints/
    llama_cpp_converter.py); where it cannot be downloaded this fails, it does not skip."""
    from tools.checkpoints.llama_cpp_converter import convert
    from tools.checkpoints.make_checkpoint import make_checkpoint

    tmp = tmp_path_factory.mktemp("llama3")
    checkpoint = make_checkpoint(tmp / "hf", hidden_size=64, num_heads=2, num_kv_heads=1, vocab_size=320,
                                 initializer_range=0.2, rope_scaling=LLAMA3)
    return checkpoint, convert(checkpoint, tmp / "llama3-f32.gguf")


@pytest.mark.e2e
def test_llama3_file_made_by_llama_cpp_builds_and_matches_transformers(converted, tmp_path):
    """A Llama-3-shaped file from llama.cpp's own converter (rope_freqs.weight, no rope metadata) builds, and its
    engine matches transformers on the HF checkpoint the file was converted from (logits within 1e-4 at every
    position, greedy tokens identical). That is the reference for "exact" here because transformers' GGUF
    loader drops rope_freqs.weight (its tensor map has no entry for it) and would run the file unscaled; the
    builder's own reference model (load_reference) gets the staged config, which names the llama3 scaling."""
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint, path = converted
    model = open_gguf(path)
    assert "rope_freqs.weight" in model.tensors and not any("rope.scaling" in k for k in model.metadata)
    config = json.loads((stage_gguf(path, log=lambda _: None) / "config.json").read_text())
    assert config["rope_scaling"] == LLAMA3
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    unscaled = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert unscaled.config.rope_parameters["rope_type"] == "default"  # transformers' own reading of the file
    _check_engine(_build(path, tmp_path / "engine"), hf, unscaled, _prompts(320))


def _converter_rope_freqs(rope: dict, head_dim: int, theta: float) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter makes it (its LlamaModel.generate_extra_tensors, run in a
    subprocess over the extracted converter) for a model of `head_dim` with rope parameters `rope`."""
    from tools.checkpoints.llama_cpp_converter import converter

    src = converter(log=lambda _: None)
    script = f"""
import json, sys, types
sys.path[:0] = [{str(src)!r}, {str(src / 'gguf-py')!r}]
from conversion.llama import LlamaModel
stub = types.SimpleNamespace(rope_parameters={json.dumps({**rope, "rope_theta": theta})},
                             hparams={{"head_dim": {head_dim}}}, format_tensor_name=lambda kind: "rope_freqs.weight")
(name, value), = LlamaModel.generate_extra_tensors(stub)
print(json.dumps(value.tolist()))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return np.asarray(json.loads(out), np.float32)


def _with(path: Path, out: Path, keys: dict | None = None, tensors: dict | None = None, arch: str = "llama") -> Path:
    """A copy of the GGUF at `path` with metadata `keys` (name after "<arch>." -> value) and float32 `tensors` added."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from tests.builder.test_gguf import _copy_key

    model = open_gguf(path)
    writer = GGUFWriter(str(out), arch=arch)
    replaced = {f"{arch}.{key}" for key in keys or {}}
    for key, value in model.metadata.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and key not in replaced:
            _copy_key(writer, model, key, value)
    for key, value in (keys or {}).items():
        _copy_key(writer, model, f"{arch}.{key}", value)
    for t in model.tensors.values():
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=GGMLQuantizationType[t.type])
    for name, value in (tensors or {}).items():
        writer.add_tensor(name, np.asarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 8B, Llama 3.2 1B/3B
def test_llama_3x_factors_read_as_their_llama3_scaling(factor, tmp_path):
    """The factors llama.cpp's converter writes for Llama 3.1 / 3.2's rope scaling (head_dim 128, base 500000,
    low 1, high 4, original context 8192) stage as exactly that HF rope_scaling."""
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    base = write_llama(tmp_path / "base.gguf", {}, hidden=256, inter=256, heads=2, kv_heads=1)
    freqs = _converter_rope_freqs(rope, 128, 500000.0)
    path = _with(base, tmp_path / "llama3.gguf", keys={"rope.freq_base": 500000.0},
                 tensors={"rope_freqs.weight": freqs})
    config = json.loads((stage_gguf(path, log=lambda _: None) / "config.json").read_text())
    assert config["rope_scaling"] == rope and config["rope_theta"] == 500000.0
    assert {1.0, factor} < set(freqs.tolist())  # factors 1, `factor` and smoothed ones between


# -- rope.scaling metadata, files written with gguf's GGUFWriter ---------------------------------------------------
SCALINGS = [  # (arch, GGUF keys, the HF rope_scaling they are)
    ("llama", {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ("llama", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64,
               "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ("qwen3", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    pytest.param("gemma3", {"rope.scaling.type": "linear", "rope.scaling.factor": 8.0},
                 {"rope_type": "linear", "factor": 8.0}, marks=pytest.mark.e2e),  # ~25 s
]
SHAPES = {"llama": dict(hidden=128, heads=4), "qwen3": dict(hidden=256, heads=2),  # transformers' GGUF config
          "gemma3": dict(hidden=512, heads=2, layers=3)}  # leaves Qwen3's head_dim at 128, Gemma 3's scalar at 256


@pytest.mark.parametrize("arch,keys,hf", SCALINGS, ids=["llama-linear", "llama-yarn", "qwen3-yarn", "gemma3-linear"])
def test_metadata_rope_scaling_builds_and_matches_transformers(arch, keys, hf, tmp_path):
    """A file with `rope.scaling.*` keys matches transformers loaded from the same file with the matching HF
    rope_scaling given (transformers' GGUF loader reads rope.scaling for gpt-oss only). Gemma 3: transformers
    takes the staged config (it reads none of Gemma 3's layer keys either), whose scaling is the global layers'."""
    import torch
    from transformers import AutoModelForCausalLM

    shape = SHAPES[arch]
    base = write_llama(tmp_path / "base.gguf", {"q": "Q8_0", "k": "Q4_0", "gate": "Q4_1"}, inter=256,
                       kv_heads=shape["heads"] // 2, arch=arch, **shape)
    path = _with(base, tmp_path / "scaled.gguf", keys=keys, arch=arch)
    staged = stage_gguf(path, log=lambda _: None)
    config, unscaled = _reference_configs(arch, path, staged, hf)

    def load(c):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=c,
                                                    dtype=torch.float32).eval()

    _check_engine(_build(path, tmp_path / "engine"), load(config), load(unscaled), _prompts(300))


def _reference_configs(arch: str, path: Path, staged: Path, hf: dict):
    """(transformers' config with the HF rope scaling `hf`, the same without it), after checking the staged one."""
    from transformers import AutoConfig

    staged_json = json.loads((staged / "config.json").read_text())
    if arch == "gemma3":
        rope = staged_json["rope_parameters"]
        assert rope["full_attention"] == {**hf, "rope_theta": rope["full_attention"]["rope_theta"]}
        assert rope["sliding_attention"]["rope_type"] == "default"
        config, unscaled = AutoConfig.from_pretrained(staged), AutoConfig.from_pretrained(staged)
        unscaled.rope_parameters["full_attention"] = {"rope_type": "default",
                                                      "rope_theta": rope["full_attention"]["rope_theta"]}
        return config, unscaled
    assert staged_json["rope_scaling"] == hf
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    unscaled = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert unscaled.rope_parameters["rope_type"] == "default"  # transformers' own reading of the file
    config.rope_parameters = {**hf, "rope_theta": config.rope_parameters["rope_theta"]}
    return config, unscaled


REFUSED = [  # (keys, tensors, arch, what the error names)
    ({"rope.scaling.type": "longrope"}, {}, "llama", r"llama.rope.scaling.type 'longrope' is not supported; "
                                                     r"supported: \['none', 'linear', 'yarn'\], or rope_freqs"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64,
      "rope.scaling.yarn_beta_fast": 16.0}, {}, "llama",
     r"llama.rope.scaling.yarn_beta_fast = 16.0 is not supported with rope scaling 'yarn' \(read at "
     r"llama.cpp's default 32.0 only\); read: \['llama.rope.scaling.factor'"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64,
      "rope.scaling.yarn_attn_factor": 1.0}, {}, "qwen2",
     r"qwen2.rope.scaling.yarn_attn_factor = 1.0 is not supported with rope scaling 'yarn'; read"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0, "rope.scaling.attn_factor": 0.5}, {}, "llama",
     r"llama.rope.scaling.attn_factor = 0.5 is not supported with rope scaling 'linear' \(read at llama.cpp's "
     r"default 1.0 only\)"),
    ({"rope.scaling.attn_factor": 0.5}, {}, "llama",
     r"llama.rope.scaling.attn_factor = 0.5 is not supported with rope scaling 'none'"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, {}, "llama",
     r"rope scaling 'yarn' without \['llama.rope.scaling.original_context_length'\]"),
    ({}, {"rope_freqs.weight": np.linspace(1, 3, 16)}, "llama",
     r"rope_freqs.weight \(.*\) is not what llama.cpp's converter writes for any llama3 rope scaling"),
    ({}, {"rope_freqs.weight": np.full(8, 2.0)}, "llama", r"rope_freqs.weight has shape \(8,\).*expected 16"),
    ({}, {"rope_freqs.weight": np.full(16, 2.0)}, "qwen2", r"rope_freqs.weight is read in llama files without"),
]


@pytest.mark.parametrize("keys,tensors,arch,message", REFUSED,
                         ids=["longrope", "yarn-beta", "yarn-attn-factor", "linear-attn-factor", "none-attn-factor",
                              "yarn-no-original", "random-factors", "factors-shape",
                              "factors-qwen2"])
def test_unsupported_rope_scaling_is_refused_by_name_before_any_work(keys, tensors, arch, message, tmp_path):
    base = write_llama(tmp_path / "base.gguf", {}, hidden=128, inter=128, heads=4, kv_heads=2, arch=arch)
    path = _with(base, tmp_path / "scaled.gguf", keys=keys, tensors=tensors, arch=arch)
    with pytest.raises(GGUFError, match=message):
        _build(path, tmp_path / "engine")
    assert not (tmp_path / "engine").exists()
    assert not list((tmp_path / "cache" / "engine-builder" / "gguf").glob("scaled-*"))  # nothing staged
