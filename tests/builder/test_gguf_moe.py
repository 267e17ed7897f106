"""Engines built from mixture-of-experts GGUF files (builder/gguf/), on files the tests write themselves
(tests/builder/gguf_files.py write_moe): Mixtral (a llama file with llama.expert_count), Qwen2-MoE (with its
shared expert), Qwen3-MoE and gpt-oss (MXFP4 experts, dequantized exactly).

- the stacked experts' integers reach QMoE as the file holds them (every symmetric type without block minimums,
  mixed within a layer: bit for bit the file's dequantized values);
- each family matches transformers (logits within 3e-5 of the largest, at accuracy_level 0; greedy identical):
  loaded from the same file where transformers' GGUF loader reads the architecture (qwen2moe, qwen3moe), and
  always the Hugging Face model the file was written from (transformers cannot read Mixtral's experts from a
  llama file, nor llama.cpp's gpt-oss tensor names);
- an MoE file of an architecture we do not run is refused by name (a type no tensor may have, experts
  included: tests/builder/test_gguf.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from builder.gguf.checkpoint import GGUFCheckpoint, stage_gguf
from builder.gguf.reader import GGUFError, open_gguf
from tests.builder.gguf_files import write_moe

pytest.importorskip("gguf")
HIDDEN, MOE_INTER, SHARED_INTER, EXPERTS, TOP_K, HEADS, KV_HEADS, VOCAB = 64, 64, 96, 4, 2, 4, 2, 320


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _hf_model(arch: str, weights: dict[str, np.ndarray]):
    """transformers' model of the family, configured by hand from write_moe's sizes, holding `weights`."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, \
        Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=256, tie_word_embeddings=False, num_experts_per_tok=TOP_K)
    if arch == "llama":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=MOE_INTER, num_local_experts=EXPERTS, **common))
    elif arch == "gpt-oss":  # write_moe's window of 4 on the even layers, plain rope
        del common["rope_theta"]
        model = GptOssForCausalLM(GptOssConfig(intermediate_size=MOE_INTER, num_local_experts=EXPERTS, sliding_window=4,
                                               layer_types=["sliding_attention", "full_attention"],
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                               **common))
    elif arch == "qwen2moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(num_experts=EXPERTS, moe_intermediate_size=MOE_INTER,
                                                   shared_expert_intermediate_size=SHARED_INTER,
                                                   norm_topk_prob=False, **common))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=MOE_INTER,
                                                   norm_topk_prob=True, **common))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    return model.eval()


def _build(model: Path, out: Path, **settings) -> dict:
    from builder.build import build_engine
    from builder.recipe import load_recipe

    overrides = ["limits.max_seq_len=64", "limits.max_batch_size=2", "quantization.accuracy_level=0",
                 "verify.enabled=off", *(f"{k}={v}" for k, v in settings.items())]
    engine = build_engine(load_recipe(base={"model": str(model)}, overrides=overrides), out, log=lambda _: None)
    return json.loads((engine / "manifest.json").read_text())


PROMPTS = [np.random.default_rng(0).integers(0, 300, n).tolist() for n in (17, 9)]


def _logits(model) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].numpy() for p in PROMPTS]


def _greedy(model, prompt: list[int], count: int) -> list[int]:
    """transformers' greedy tokens by full forwards (generate() would mask prompt tokens equal to its pad id)."""
    import torch

    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def _relative_error(engine: Path, expected: list[np.ndarray]) -> float:
    """max |logit error| relative to the largest |logit| (the measure of tests/builder/test_gguf.py)."""
    from builder.reference_check import compare, engine_logits

    error, _ = compare(engine_logits(engine, PROMPTS), expected)
    return error / max(1.0, max(float(np.abs(e).max()) for e in expected))


def _engine_greedy(engine: Path, count: int) -> list[list[int]]:
    from runtime.engine import LLM
    from runtime.request.params import SamplingParams

    llm = LLM(engine)
    try:
        return [r.token_ids for r in llm.generate(PROMPTS, SamplingParams(max_new_tokens=count, ignore_eos=True))]
    finally:
        llm.close()


FAMILY_CASES = [  # (arch, types, experts as the manifest records them)
    ("qwen3moe", {"gate_exps": "Q4_0", "up_exps": "Q4_0", "down_exps": "Q4_0", "attn": "Q4_1"}, (4, 32)),
    ("llama", {"gate_exps": "Q4_0", "up_exps": "Q4_0", "down_exps": "Q4_0", "embed": "Q4_0"}, (4, 32)),
    # only the experts block-quantized: every linear float, the experts still the file's integers
    ("qwen3moe", {"gate_exps": "Q4_0", "up_exps": "Q4_0", "down_exps": "Q4_0", "attn": "F32", "embed": "F32",
                  "output": "F32"}, (4, 32)),
    # 8-bit experts: QMoE's 8-bit block kernels quantize activations, so accuracy_level 0 keeps them float
    ("qwen2moe", {"gate_exps": "Q8_0", "up_exps": "Q8_0", "down_exps": "Q8_0", "shexp": "Q4_0"}, None),
    # i-quant experts: 8-bit codes (builder/gguf/repack.py), kept float at accuracy_level 0 like Q8_0's
    ("qwen3moe", {"gate_exps": "IQ4_NL", "up_exps": "IQ4_NL", "down_exps": "IQ4_NL"}, None),
    # MXFP4 experts: dequantized exactly (QMoE's fp4 has no CPU kernel)
    ("gpt-oss", {"gate_exps": "MXFP4", "up_exps": "MXFP4", "down_exps": "MXFP4", "attn": "Q4_0"}, None),
]


@pytest.mark.parametrize("arch,types,layout", FAMILY_CASES)
def test_moe_engine_matches_transformers(arch, types, layout, tmp_path):
    """The engine against the Hugging Face model the file was written from and, where transformers' GGUF loader
    reads the architecture, against transformers loaded from the same file: logits within 3e-5 of the largest,
    greedy tokens identical."""
    from builder.gguf.checkpoint import load_reference

    path = tmp_path / f"{arch}.gguf"
    weights = write_moe(path, arch, types, hidden=HIDDEN, moe_inter=MOE_INTER, experts=EXPERTS, top_k=TOP_K,
                        heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB, shared_inter=SHARED_INTER)
    manifest = _build(path, tmp_path / "engine")
    record = manifest["quantization"]
    assert record["source"]["format"] == "gguf"
    assert record["source"]["tensor_types"]["model.layers.0.mlp.experts.gate_up_proj"] == types["gate_exps"]
    experts = list(record["experts"].values())
    assert len(experts) == 2
    if layout:  # every sparse layer a QMoE over the file's integers
        assert all((e["bits"], e["block_size"]) == layout and "own integers" in e["experts"] for e in experts), experts
    else:
        assert all(e["experts"].startswith("float") for e in experts), experts
    model = _hf_model(arch, weights)
    expected = _logits(model)
    assert _relative_error(tmp_path / "engine", expected) < 3e-5
    if arch.startswith("qwen"):  # transformers reads qwen2moe / qwen3moe files itself (not Mixtral's, gpt-oss's)
        from_file = _logits(load_reference(stage_gguf(path, log=lambda _: None)).eval())
        assert _relative_error(tmp_path / "engine", from_file) < 3e-5
    assert _engine_greedy(tmp_path / "engine", 8) == [_greedy(model, p, 8) for p in PROMPTS]


def test_8bit_and_4bit_experts_share_one_qmoe_at_accuracy_level_4(tmp_path):
    """Q4_0 gate/up beside a Q8_0 down: one 8-bit QMoE in blocks of 32 at accuracy_level 4 (int8 activations),
    its integers the file's (the 4-bit codes widened); close to transformers, not exact."""
    path = tmp_path / "m.gguf"
    weights = write_moe(path, "qwen3moe", {"gate_exps": "Q4_0", "up_exps": "Q4_0", "down_exps": "Q8_0"},
                        hidden=HIDDEN, moe_inter=MOE_INTER, experts=EXPERTS, top_k=TOP_K, heads=HEADS,
                        kv_heads=KV_HEADS, vocab=VOCAB)
    manifest = _build(path, tmp_path / "engine", **{"quantization.accuracy_level": 4})
    experts = list(manifest["quantization"]["experts"].values())
    assert all((e["bits"], e["block_size"]) == (8, 32) for e in experts), experts
    error = _relative_error(tmp_path / "engine", _logits(_hf_model("qwen3moe", weights)))
    assert 0 < error < 2e-2, error


MIXED = [  # (gate, up, down) types of one layer -> the (bits, block) QMoE reads them in exactly
    (("Q4_0", "Q4_0", "Q4_0"), (4, 32)), (("Q8_0", "Q8_0", "Q5_0"), (8, 32)), (("Q4_0", "Q4_0", "Q8_0"), (8, 32)),
    (("Q6_K", "Q6_K", "Q8_0"), (8, 16)), (("Q3_K", "Q3_K", "Q4_0"), (4, 16)), (("Q3_K", "Q4_0", "Q6_K"), (8, 16)),
    (("Q4_K", "Q4_K", "Q6_K"), None), (("F16", "F16", "Q8_0"), None), (("IQ4_NL", "IQ4_NL", "Q8_0"), (8, 32)),
]


@pytest.mark.parametrize("types,layout", MIXED)
def test_stored_expert_integers_are_the_files_values_bit_for_bit(types, layout, tmp_path):
    """A layer's experts in the IR layout (gate/up interleaved): the QMoE arrays dequantize, bit for bit, to
    gguf's own dequantize of the file's bytes; a type with block minimums, or a float one, has no such form."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as oracle

    from builder.quant.experts import ImportedExperts, stored_layout
    from builder.quant.schemes import QuantizedArrays, dequantize
    from builder.trace_moe import ExpertLayout

    path = tmp_path / "m.gguf"
    write_moe(path, "qwen3moe", dict(zip(("gate_exps", "up_exps", "down_exps"), types)), hidden=256, moe_inter=256,
              experts=2, layers=1, heads=2, kv_heads=1, vocab=VOCAB)
    checkpoint = GGUFCheckpoint(stage_gguf(path, log=lambda _: None))
    gate_up = ExpertLayout(checkpoint.source("model.layers.0.mlp.experts.gate_up_proj"), "gate_up_proj",
                           interleave=True)
    down = ExpertLayout(checkpoint.source("model.layers.0.mlp.experts.down_proj"), "down_proj")
    assert stored_layout([gate_up, down]) == layout
    if layout is None:
        return
    model = open_gguf(path)

    def file_value(name: str) -> np.ndarray:
        t = model.tensors[name]
        return oracle(np.asarray(t.data), GGMLQuantizationType[t.type])

    expected = {gate_up: gate_up.arrange(np.concatenate([file_value("blk.0.ffn_gate_exps.weight"),
                                                         file_value("blk.0.ffn_up_exps.weight")], axis=1)),
                down: file_value("blk.0.ffn_down_exps.weight")}
    bits, block = layout
    for source, want in expected.items():
        arrays = ImportedExperts(source, bits, block).make()
        experts, n, k = source.shape
        got = np.stack([dequantize(QuantizedArrays(arrays["q"][e].reshape(n, k // block, -1), arrays["scales"][e],
                                                   None), bits, block, k) for e in range(experts)])
        np.testing.assert_array_equal(got.view(np.uint32), np.ascontiguousarray(want, np.float32).view(np.uint32))


# -- refusals --------------------------------------------------------------------------------------------


def test_moe_file_of_an_architecture_we_do_not_run_is_refused_by_name(tmp_path):
    path = tmp_path / "m.gguf"
    write_moe(path, "deepseek2", {}, hidden=HIDDEN, moe_inter=MOE_INTER, vocab=VOCAB)
    with pytest.raises(GGUFError, match=r"mixture-of-experts GGUF of architecture 'deepseek2' \(tensor "
                                        r"'blk.0.ffn_gate_exps.weight', Q4_0 \[4, 64, 64\]\) is not supported; "
                                        r"supported mixture-of-experts architectures: llama \(Mixtral"):
        _build(path, tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


def test_mxfp4_reads_as_gguf_dequantizes_it_bit_for_bit():
    """Random blocks, the exponent's extremes included (2^-128 subnormal halves, 2^127 overflowing to inf)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as oracle

    from builder.gguf.repack import read_mxfp4

    raw = np.random.default_rng(2).integers(0, 256, (32, 17 * 8), dtype=np.uint8)
    raw[:8, 0::17] = np.array([0, 1, 2, 126, 127, 128, 254, 255], np.uint8)[:, None]
    with np.errstate(over="ignore"):
        expected = oracle(raw, GGMLQuantizationType.MXFP4).astype(np.float32)
        got = read_mxfp4(raw)
    assert np.isinf(expected).any() and (expected[expected != 0] < 1e-37).any()
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
