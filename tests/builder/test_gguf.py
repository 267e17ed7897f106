"""Engines built straight from GGUF files (builder/gguf/), on files the tests write themselves
(tests/builder/gguf_files.py).

- every supported GGML type repacks into MatMulNBits so that the engine's dequantized weight equals the
  `gguf` package's own dequantize bit for bit (through the file, the Q/K row permutation and all);
- a tiny Llama, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3 and GPT-2 built from a GGUF matches transformers loaded from the same file
  (logits within 3e-5 of the largest, at accuracy_level 0; greedy identical), with every block type in the graph;
- malformed files, unknown architectures and types are refused by name, and no engine is written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from builder.gguf.checkpoint import GGUFCheckpoint, GGUFWeight, stage_gguf
from builder.gguf.reader import GGUFError, open_gguf
from builder.gguf.repack import BLOCK_TYPES, FLOAT_TYPES, read_float, repack, symmetric_layout
from builder.quant.schemes import dequantize
from tests.builder.gguf_files import random_blocks, write_gpt2, write_llama

pytest.importorskip("gguf")
ALL_TYPES = FLOAT_TYPES + tuple(BLOCK_TYPES)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _gguf_dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as oracle

    return oracle(raw, GGMLQuantizationType[type_name])


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_block_repack_is_bit_exact_on_random_blocks(type_name):
    """Random bytes, scales and all (NaN and inf scales included: the same ops give the same NaNs)."""
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (8, random_blocks(type_name, 1, 512, rng).shape[1]), dtype=np.uint8)
    kind = BLOCK_TYPES[type_name]
    with np.errstate(invalid="ignore", over="ignore"):
        arrays, mins = repack(type_name, raw, 8, 512)
        ours = dequantize(arrays, kind.bits, kind.block, 512)
        ours = ours if mins is None else ours + np.repeat(mins, kind.block, axis=1)
        expected = _gguf_dequantize(raw, type_name)
    assert (mins is not None) == kind.minimum and (arrays.zero_points is None) == symmetric_layout(type_name, raw)
    assert np.array_equal(np.isnan(ours), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_array_equal(_bits(ours)[finite], _bits(expected)[finite])


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_engine_weight_from_a_file_equals_gguf_dequantize(type_name, tmp_path):
    """Through the file: the tensor's effective weight (HF row order) equals gguf's dequantize of the
    stored bytes with llama.cpp's Q/K permutation undone, and the weight keeps the file's own integers."""
    path = write_llama(tmp_path / "m.gguf", {"q": type_name, "down": type_name}, hidden=256, inter=512, heads=4,
                       kv_heads=2, layers=1)
    checkpoint = GGUFCheckpoint(stage_gguf(path, log=lambda _: None))
    model = open_gguf(path)
    for hf, gguf_name, heads in (("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", 4),
                                 ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", None)):
        t = model.tensors[gguf_name]
        assert t.type == type_name
        expected = read_float(t.type, t.data) if t.type in FLOAT_TYPES else _gguf_dequantize(np.asarray(t.data), t.type)
        expected = expected.reshape(t.shape)
        if heads:  # transformers' LlamaTensorProcessor._reverse_permute_weights
            expected = expected.reshape(heads, t.shape[0] // heads // 2, 2, -1).swapaxes(2, 1).reshape(t.shape)
        source = checkpoint.source(hf)
        assert isinstance(source, GGUFWeight) == (type_name in BLOCK_TYPES)
        np.testing.assert_array_equal(_bits(source.materialize()), _bits(expected), err_msg=hf)


def _build(model: Path, out: Path, **settings) -> dict:
    from builder.build import build_engine
    from builder.recipe import load_recipe

    overrides = ["limits.max_seq_len=64", "limits.max_batch_size=1", "quantization.accuracy_level=0",
                 "verify.enabled=off", *(f"{k}={v}" for k, v in settings.items())]
    engine = build_engine(load_recipe(base={"model": str(model)}, overrides=overrides), out, log=lambda _: None)
    return json.loads((engine / "manifest.json").read_text())


def _against_transformers(engine: Path, model: Path) -> tuple[float, float]:
    """(max |logit error| relative to the largest |logit|, greedy agreement): random K-quant blocks make
    logits in the hundreds, where float32 summation order alone moves them by ~1e-3."""
    from builder.reference_check import compare, engine_logits, reference_logits

    staged = stage_gguf(model, log=lambda _: None)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 300, n).tolist() for n in (17, 9)]
    theirs = reference_logits(staged, sequences)
    error, agree = compare(engine_logits(engine, sequences), theirs)
    return error / max(1.0, max(float(np.abs(t).max()) for t in theirs)), agree


FAMILY_CASES = [  # (arch, linear types, tied)
    ("llama", {"q": "Q4_0", "k": "Q4_1", "v": "Q8_0", "o": "Q5_0", "gate": "Q5_1", "up": "Q4_1", "down": "F16",
               "embed": "Q8_0"}, True),
    ("llama", {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K", "o": "Q5_K", "gate": "Q2_K", "up": "Q3_K", "down": "Q6_K",
               "embed": "Q4_1", "output": "Q6_K"}, False),
    ("qwen2", {"q": "Q8_0", "k": "Q8_0", "v": "Q8_0", "o": "Q4_0", "gate": "Q4_1", "up": "Q4_1", "down": "BF16"}, True),
    ("gemma2", {"q": "Q4_0", "k": "Q8_0", "v": "Q4_1", "o": "Q6_K", "gate": "Q4_K", "up": "Q5_0", "down": "Q8_0"},
     True),
    ("phi3", {"q": "Q8_0", "o": "Q4_K", "up": "Q5_K", "down": "Q4_1", "output": "Q6_K"}, False),
    ("qwen3", {"q": "Q5_1", "k": "Q5_1", "v": "Q5_1", "o": "Q4_K", "gate": "Q6_K", "up": "Q6_K", "down": "Q5_K",
               "embed": "Q4_1"}, True),
    # 2 local + 1 global layer (pattern 3, window 4, local base 100): transformers' GGUF loader reads none of
    # these keys, so its reference is the same file's weights with the staged config (load_reference)
    ("gemma3", {"q": "Q4_0", "k": "Q8_0", "v": "Q4_1", "o": "Q6_K", "gate": "Q4_K", "up": "Q5_0", "down": "Q5_K",
                "embed": "Q8_0"}, True),
]


@pytest.mark.parametrize("arch,types,tied", FAMILY_CASES)
def test_engine_matches_transformers_loaded_from_the_same_file(arch, types, tied, tmp_path):
    # transformers' GGUF config leaves Qwen3's head_dim at its default 128, Gemma 2's query_pre_attn_scalar at 256
    hidden, heads = {"qwen3": (256, 2), "gemma2": (512, 2), "gemma3": (512, 2)}.get(arch, (256, 4))
    path = write_llama(tmp_path / f"{arch}.gguf", types, hidden=hidden, inter=512, heads=heads, kv_heads=heads // 2,
                       tied=tied, arch=arch, layers=3 if arch == "gemma3" else 2)
    manifest = _build(path, tmp_path / "engine")
    record = manifest["quantization"]
    assert record["source"]["format"] == "gguf"
    q_proj = "qkv_proj" if arch == "phi3" else "q_proj"
    assert record["source"]["tensor_types"][f"model.layers.0.self_attn.{q_proj}.weight"] == types["q"]
    floats = [key for key, t in types.items() if t in FLOAT_TYPES]  # every block-quantized linear in its own layout
    assert all(name == "embed" or name.rsplit(".", 1)[1] in floats for name in record["skipped"]), record["skipped"]
    error, agree = _against_transformers(tmp_path / "engine", path)
    assert error < 3e-5 and agree == 1.0, (error, agree)


@pytest.mark.parametrize("v_type", ["Q4_K", "Q6_K"])
def test_qwen3_q_k_v_of_one_type_run_as_one_matmul_exactly(v_type, tmp_path):
    """Qwen3's q/k norms: q, k and v of one stored type run as one MatMulNBits (one block-minimum term) cut by a
    Split, with the logits of the engine that keeps them apart (to float rounding, at the int8-activation level
    too); a v of another type (Q6_K beside Q4_K) stays apart. Both match transformers on the same file."""
    from builder.reference_check import engine_logits

    types = {"q": "Q4_K", "k": "Q4_K", "v": v_type, "o": "Q4_K", "gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}
    path = write_llama(tmp_path / "qwen3.gguf", types, hidden=256, inter=512, heads=2, kv_heads=1, arch="qwen3")
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 300, n).tolist() for n in (17, 9)]
    for level in (0, 4):
        fused, apart = tmp_path / f"fused{level}", tmp_path / f"apart{level}"
        record = _build(path, fused, **{"quantization.accuracy_level": level})["quantization"]
        _build(path, apart, **{"quantization.accuracy_level": level, "passes.fuse_qkv": "false"})
        assert ("layers.0.qkv" in record["quantized"]) == (v_type == "Q4_K"), sorted(record["quantized"])
        terms = _minimum_terms(fused)
        assert [t for t in terms if t.split(".")[2] in ("q", "k", "v", "qkv")] == (
            ["layers.0.qkv", "layers.1.qkv"] if v_type == "Q4_K" else ["layers.0.k", "layers.0.q", "layers.1.k", "layers.1.q"])
        ours, theirs = engine_logits(fused, sequences), engine_logits(apart, sequences)
        largest = max(float(np.abs(t).max()) for t in theirs)
        assert max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)) <= 1e-5 * largest
    error, agree = _against_transformers(tmp_path / "fused0", path)
    assert error < 3e-5 and agree == 1.0, (error, agree)


def _minimum_terms(engine: Path) -> list[str]:
    """The linears with a block-minimum term in the engine's graph, sorted."""
    import onnx

    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False).graph
    return sorted(i.removesuffix(".block_minimums.T") for n in graph.node for i in n.input
                  if i.endswith(".block_minimums.T"))


def test_gpt2_engine_matches_transformers_loaded_from_the_same_file(tmp_path):
    """GPT-2: the file's [out, in] linears are used as stored (HF's Conv1D holds them [in, out])."""
    path = write_gpt2(tmp_path / "gpt2.gguf", {"qkv": "Q4_1", "o": "Q5_K", "up": "Q4_0", "down": "Q6_K"}, hidden=256)
    manifest = _build(path, tmp_path / "engine")
    assert {"layers.0.qkv", "layers.0.o", "layers.0.up", "layers.0.down"} <= set(manifest["quantization"]["quantized"])
    error, agree = _against_transformers(tmp_path / "engine", path)
    assert error < 3e-5 and agree == 1.0, (error, agree)


def test_tied_embedding_with_block_minimums_stays_float_exactly(tmp_path):
    path = write_llama(tmp_path / "m.gguf", {"embed": "Q4_1"})
    manifest = _build(path, tmp_path / "engine")
    assert "kept float" in manifest["quantization"]["skipped"]["embed"]
    error, agree = _against_transformers(tmp_path / "engine", path)
    assert error < 3e-5 and agree == 1.0


def test_smollm2_shaped_file_shares_its_q8_0_embedding(tmp_path):
    """SmolLM2's layout: Q4_1 linears, a tied Q8_0 embedding read by row from the lm_head's bytes."""
    path = write_llama(tmp_path / "m.gguf", {k: "Q4_1" for k in ("q", "k", "v", "o", "gate", "up", "down")})
    manifest = _build(path, tmp_path / "engine")
    assert "embed" in manifest["quantization"]["quantized"]
    assert "GatherBlockQuantized" in (tmp_path / "engine" / "model.onnx").read_bytes().decode("latin-1")
    error, agree = _against_transformers(tmp_path / "engine", path)
    assert error < 3e-5 and agree == 1.0


# -- refusals --------------------------------------------------------------------------------------------


def _tiny(tmp_path: Path) -> Path:
    return write_llama(tmp_path / "m.gguf", {}, hidden=32, inter=64, heads=2, kv_heads=1, vocab=260)


def _corrupt(path: Path, change) -> Path:
    """Apply `change(reader)` to the file in place through a writable GGUFReader."""
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")
    change(reader)
    reader.data.flush()
    del reader
    return path


def _tensor_part(index: int, value: int):
    def change(reader):
        reader.tensors[-1].field.parts[index][0] = value
    return change


MALFORMED = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "truncated|past the end"),
    "tensor offset past the end": (lambda p: _corrupt(p, _tensor_part(5, 1 << 40)), "past the end"),
    "unknown tensor type": (lambda p: _corrupt(p, _tensor_part(4, 250)), "unknown GGML type"),
    "absurd dimensions": (lambda p: _corrupt(p, _tensor_part(3, 1 << 50)), "past the end|dimensions"),
    "absurd tensor count": (lambda p: _corrupt(p, lambda r: r.fields["GGUF.tensor_count"].parts[0].__setitem__(0, 1 << 50)),
                            "header claims 1125899906842624 tensors"),
    "string length past the end": (lambda p: _corrupt(p, lambda r: r.fields["general.architecture"].parts[0]
                                                       .__setitem__(0, 1 << 40)), "past the end|not a readable GGUF"),
    "not gguf": (lambda p: p.write_bytes(b"PK\x03\x04" + bytes(100)), "not a readable GGUF|magic"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_is_refused_by_name_and_writes_nothing(case, tmp_path):
    damage, message = MALFORMED[case]
    path = _tiny(tmp_path)
    damage(path)
    with pytest.raises(GGUFError, match=message) as info:
        _build(path, tmp_path / "engine")
    assert str(path) in str(info.value)
    assert not (tmp_path / "engine").exists()


def test_tensor_parallel_split_inside_a_block_and_own_quantization_are_refused(tmp_path, monkeypatch):
    """_tiny's o_proj has head_dim 16 columns per head: 2 ranks would cut its Q8_0 blocks of 32 in half. A
    quantization.mode of the recipe's own is refused in one line before tracing (issue 48: it came after it)."""
    import builder.build
    from builder.recipe import RecipeError

    path = _tiny(tmp_path)
    with pytest.raises(Exception, match=r"o_proj.weight \(gguf_Q8_0, 8-bit blocks\): tensor parallelism would split its columns at \[0, 16\), inside its blocks of 32"):
        _build(path, tmp_path / "engine", **{"parallel.tensor_parallel": 2})
    monkeypatch.setattr(builder.build, "trace", lambda *a, **k: pytest.fail("traced before refusing"))
    with pytest.raises(RecipeError) as info:
        _build(path, tmp_path / "engine", **{"quantization.mode": "int8"})
    assert str(info.value) == (f"quantization.mode int8: {path} is already quantized (a GGUF file), and its integers are "
                               f"imported as they are; allowed: quantization.mode none (accuracy_level still applies)")
    assert not (tmp_path / "engine").exists()


TP_TYPES = {"q": "Q4_K", "k": "Q4_1", "v": "Q6_K", "o": "Q4_1", "gate": "Q2_K", "up": "Q5_1", "down": "Q4_K",
            "embed": "Q8_0"}  # every row-parallel (column-split) linear with 4-bit zero points and block minimums


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q2_K", "Q5_1", "Q6_K", "Q4_0"])
def test_shards_keep_the_files_integers_bit_for_bit(type_name, tmp_path):
    """A rank's rows, or whole blocks of columns (an odd count of 4-bit zero points included), of a GGUF weight
    are pre-quantized weights whose value is that part of the file's dequantized weight, bit for bit."""
    from builder.shard_weights import shard

    path = write_llama(tmp_path / "m.gguf", {"down": type_name}, hidden=256, inter=512, layers=1)
    source = GGUFCheckpoint(stage_gguf(path, log=lambda _: None)).source("model.layers.0.mlp.down_proj.weight")
    full, block = source.materialize(), source.block
    for axis, ranges in ((0, [(0, 64), (128, 192)]), (1, [(block, 4 * block)]), (1, [(256, 512)])):
        part = shard(source, axis, ranges)
        expected = np.concatenate([full.take(np.arange(lo, hi), axis=axis) for lo, hi in ranges], axis=axis)
        assert all(isinstance(p, GGUFWeight) for p in getattr(part, "parts", [part]))
        np.testing.assert_array_equal(_bits(part.materialize()), _bits(expected))


@pytest.mark.e2e
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])  # Gemma 3, Qwen3: 2 query heads over 1 KV head
def test_two_ranks_keep_the_files_blocks_and_match_transformers(arch, tmp_path):
    """Tensor parallelism over a GGUF: each rank keeps the file's own integers (q/k/v and gate/up split by rows,
    o/down by whole blocks of columns, their block minimums with them; Qwen3's q/k/v of one type fused before
    its q/k norms, each part's rows kept); 2 ranks match transformers loaded from the same file (logits within
    3e-5 of the largest, greedy tokens identical) and the 1-rank engine."""
    import torch

    from builder.gguf.checkpoint import load_reference
    from runtime.engine import LLM
    from runtime.request.params import SamplingParams
    from tests.builder.test_families import batch_logits

    hidden, heads, layers = {"gemma3": (512, 2, 3), "qwen3": (256, 2, 2)}.get(arch, (256, 4, 2))
    types = TP_TYPES | ({"k": "Q4_K", "v": "Q4_K"} if arch == "qwen3" else {})
    path = write_llama(tmp_path / "m.gguf", types, hidden=hidden, inter=512, heads=heads, kv_heads=heads // 2,
                       layers=layers, arch=arch)
    manifest = _build(path, tmp_path / "engine", **{"parallel.tensor_parallel": 2, "limits.max_batch_size": 2})
    assert manifest["quantization"]["source"]["format"] == "gguf"
    assert ("layers.0.qkv" in manifest["quantization"]["quantized"]) == (arch == "qwen3")
    assert not manifest["quantization"]["skipped"], manifest["quantization"]["skipped"]  # all kept in blocks
    _build(path, tmp_path / "one", **{"limits.max_batch_size": 2})
    model = load_reference(stage_gguf(path, log=lambda _: None)).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 300, n).tolist() for n in (17, 9)]
    with torch.no_grad():
        expected = [model(torch.tensor([p])).logits[0].numpy() for p in prompts]
        greedy = [_greedy(model, p, 8) for p in prompts]
    largest = max(float(np.abs(e).max()) for e in expected)
    one = LLM(tmp_path / "one")
    try:
        single = batch_logits(one, prompts)
    finally:
        one.close()
    llm = LLM(tmp_path / "engine")
    try:
        assert llm.manifest.tensor_parallel.size == 2
        for got, alone, want in zip(batch_logits(llm, prompts), single, expected):  # as close as one rank is
            assert float(np.abs(got - want).max()) / largest < 1e-4 and float(np.abs(alone - want).max()) / largest < 1e-4
            assert float(np.abs(got - alone).max()) / largest < 1e-4
        results = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert [r.token_ids for r in results] == greedy
    finally:
        llm.close()


def _greedy(model, prompt: list[int], count: int) -> list[int]:
    """transformers' greedy tokens by full forwards (generate() would mask prompt tokens equal to its pad id)."""
    import torch

    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.e2e
def test_gguf_draft_model_is_staged_and_manifests_name_the_files(tmp_path):
    """A .gguf speculative.draft_model is staged like the model; both manifests, and the pair's record, name
    the GGUF files (the staged directory is quantization.source.staged); drafting leaves greedy tokens as
    plain decoding gives them."""
    from runtime.engine import LLM
    from runtime.request.params import SamplingParams
    from runtime.speculation.speculator import Speculation

    target = write_llama(tmp_path / "target.gguf", {"q": "Q4_1", "down": "Q4_K"}, hidden=256, inter=512)
    draft = write_llama(tmp_path / "draft.gguf", {}, hidden=64, inter=128, layers=1, heads=2, kv_heads=1, seed=3)
    manifest = _build(target, tmp_path / "engine", **{"speculative.draft_model": str(draft),
                                                      "limits.max_batch_size": 2})
    draft_manifest = json.loads((tmp_path / "engine" / "draft" / "manifest.json").read_text())
    for record, file in ((manifest, target), (draft_manifest, draft)):
        assert record["recipe"]["model"] == str(file) and record["model"]["source"] == str(file.resolve())
        assert GGUFCheckpoint(record["quantization"]["source"]["staged"]).model.path == file.resolve()
    assert manifest["recipe"]["speculative"]["draft_model"] == manifest["speculative"]["draft_model"] == str(draft)
    llm = LLM(tmp_path / "engine")
    try:
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        prompt = [3, 100, 7, 3, 100, 7, 3, 100]
        plain = llm.generate([prompt], params)[0]
        spec = llm.generate([prompt], params, speculation=Speculation("draft"))[0]
        assert spec.token_ids == plain.token_ids and spec.metrics["speculation"]["drafted"] > 0
    finally:
        llm.close()


def test_gguf_draft_model_that_is_missing_is_refused_by_name(tmp_path):
    with pytest.raises(GGUFError, match=r"speculative.draft_model '.*nothere.gguf': no such GGUF file"):
        _build(_tiny(tmp_path), tmp_path / "engine", **{"speculative.draft_model": str(tmp_path / "nothere.gguf")})
    assert not (tmp_path / "engine").exists()


def test_unsupported_architecture_is_refused_with_the_list(tmp_path):
    path = write_llama(tmp_path / "m.gguf", {}, hidden=32, inter=64, heads=2, kv_heads=1, vocab=260, arch="mamba")
    with pytest.raises(GGUFError, match=r"'mamba' is not supported; supported: \[.*'llama'.*'qwen3'"):
        _build(path, tmp_path / "engine")


def test_type_we_cannot_carry_exactly_is_refused_by_name(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    path = _tiny(tmp_path)
    model = open_gguf(path)
    writer = GGUFWriter(str(tmp_path / "iq.gguf"), arch="llama")
    for key, value in model.metadata.items():  # the same metadata, one tensor rewritten as Q8_1
        if not key.startswith("GGUF.") and key != "general.architecture":
            _copy_key(writer, model, key, value)
    for t in model.tensors.values():
        if t.name == "blk.0.ffn_up.weight":
            writer.add_tensor(t.name, np.zeros((t.shape[0], t.shape[1] // 32 * 40), np.uint8),
                              raw_dtype=GGMLQuantizationType.Q8_1)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=GGMLQuantizationType[t.type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_up.weight' is stored as Q8_1.*supported GGUF types: F32"):
        _build(tmp_path / "iq.gguf", tmp_path / "engine")


def _copy_key(writer, model, key, value) -> None:
    from gguf import GGUFValueType

    if isinstance(value, list):
        if value and isinstance(value[0], str):
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, value)


def test_split_gguf_reads_as_one_model(tmp_path):
    path = _tiny(tmp_path)
    model = open_gguf(path)
    names = list(model.tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    from gguf import GGMLQuantizationType, GGUFWriter

    for index, part in enumerate(halves, start=1):
        writer = GGUFWriter(str(tmp_path / f"m-{index:05d}-of-00002.gguf"), arch="llama")
        if index == 1:
            for key, value in model.metadata.items():
                if not key.startswith("GGUF.") and key != "general.architecture":
                    _copy_key(writer, model, key, value)
        for name in part:
            t = model.tensors[name]
            writer.add_tensor(name, np.asarray(t.data), raw_dtype=GGMLQuantizationType[t.type])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    split = open_gguf(tmp_path / "m-00001-of-00002.gguf")
    assert set(split.tensors) == set(names)
    for name in names:
        np.testing.assert_array_equal(np.asarray(split.tensors[name].data), np.asarray(model.tensors[name].data))
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(GGUFError, match="missing"):
        open_gguf(tmp_path / "m-00001-of-00002.gguf")


def test_config_without_architectures_falls_back_to_model_type():
    from transformers import LlamaConfig

    from builder.trace import _architecture

    config = LlamaConfig()
    config.architectures = None
    assert _architecture(config) == "LlamaForCausalLM"


def test_stage_is_reused_while_the_file_is_unchanged(tmp_path):
    path = _tiny(tmp_path)
    logs: list[str] = []
    first = stage_gguf(path, log=logs.append)
    assert stage_gguf(path, log=logs.append) == first and "reused" in logs[-1]
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in first.iterdir()}
    shutil.rmtree(first)


def test_gemma3_config_carries_llama_cpp_defaults():
    """What llama.cpp hard-codes for Gemma 3 where the file has no key: local rope base 10000, five
    sliding-window layers per global one, queries scaled by 1/sqrt(head_dim)."""
    from transformers import AutoConfig

    from builder.gguf.arch import ARCHITECTURES, hf_config
    from builder.gguf.reader import GGUFModel

    meta = {"general.architecture": "gemma3", "gemma3.block_count": 12, "gemma3.embedding_length": 640,
            "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
            "gemma3.feed_forward_length": 2048, "gemma3.rope.freq_base": 1000000.0, "gemma3.vocab_size": 1000,
            "gemma3.attention.sliding_window": 512}
    config = hf_config(GGUFModel(Path("g.gguf"), [], meta, {}), ARCHITECTURES["gemma3"])
    built = AutoConfig.for_model(**config)
    assert built.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert built.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert built.rope_parameters["full_attention"]["rope_theta"] == 1000000.0
    assert built.query_pre_attn_scalar == 256 and built.sliding_window == 512 and built.tie_word_embeddings


@pytest.mark.parametrize("keys,layer_types,local_base,scalar", [
    ({"gemma3.attention.sliding_window_pattern": 3}, ["sliding_attention"] * 2 + ["full_attention"], 10000.0, 256),
    ({"gemma3.attention.sliding_window_pattern": [True, False, True], "gemma3.rope.freq_base_swa": 50.0},
     ["sliding_attention", "full_attention", "sliding_attention"], 50.0, 256),
    ({"gemma3.block_count": 62}, None, 10000.0, 640 // 4),  # the 27B: hidden / heads
])
def test_gemma3_config_reads_pattern_local_base_and_the_27b_scalar(keys, layer_types, local_base, scalar):
    from builder.gguf.arch import ARCHITECTURES, hf_config
    from builder.gguf.reader import GGUFModel

    meta = {"general.architecture": "gemma3", "gemma3.block_count": 3, "gemma3.embedding_length": 640,
            "gemma3.attention.head_count": 4, "gemma3.attention.key_length": 256, "gemma3.vocab_size": 1000, **keys}
    config = hf_config(GGUFModel(Path("g.gguf"), [], meta, {}), ARCHITECTURES["gemma3"])
    if layer_types:
        assert config["layer_types"] == layer_types
    else:
        assert config["layer_types"][4:6] == ["sliding_attention", "full_attention"]
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == local_base
    assert config["query_pre_attn_scalar"] == scalar
    with pytest.raises(GGUFError, match="2 entries for 3 layers"):
        hf_config(GGUFModel(Path("g.gguf"), [], {**meta, "gemma3.block_count": 3,
                                                 "gemma3.attention.sliding_window_pattern": [True, False]}, {}),
                  ARCHITECTURES["gemma3"])
