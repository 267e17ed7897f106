"""Quantized lm_head and a tied embedding stored once: the QuantizeMapping's lm_head choices, the
Before/After of QuantizeWeights on a tied graph (Embedding -> QuantEmbedding over the lm_head's own
bytes), and engines built from tiny tied checkpoints against transformers with the effective weights."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from builder.build import build_engine
from builder.ir import Graph
from builder.pass_manager import PassManager
from builder.pipeline import pipeline
from builder.passes.quantize_weights import QuantizeWeights
from builder.quant import INT8_BLOCK, effective_weights
from builder.recipe import Quantization, RecipeError, load_recipe
from builder.reference_check import engine_logits, reference_logits
from builder.trace import trace
from runtime.manifest.load import load_manifest
from tools.checkpoints.make_checkpoint import make_checkpoint

from test_sampling_head import head_graph

VOCAB, HIDDEN = 40, 64


def tied_graph(hidden: int = HIDDEN) -> Graph:
    """ids -> Embedding(embed) -> Linear(a) -> GatherTokens -> Linear(embed) -> logits."""
    return head_graph(VOCAB, hidden, tied=True, inner=True)


def test_tied_embedding_shares_the_quantized_lm_head():
    before = tied_graph()
    after = QuantizeWeights(Quantization("int4_rtn", group_size=32, exclude=[], lm_head="same")).run(before)
    assert [n.op for n in before.nodes] == ["Embedding", "Linear", "GatherTokens", "Linear"]
    assert [n.op for n in after.nodes] == ["QuantEmbedding", "QuantLinear", "GatherTokens", "QuantLinear"]
    embedding, head = after.nodes[0], after.nodes[-1]
    assert embedding.inputs == ["input_ids", "embed.q", "embed.scales"] == [embedding.inputs[0]] + head.inputs[1:]
    assert embedding.attrs == {"bits": 4, "block_size": 32, "K": HIDDEN}
    assert "embed" not in after.weights and after.values["embed.q"].shape == (VOCAB, 2, 16)
    assert sorted(after.meta.quantization.record["quantized"]) == ["a", "embed"]


@pytest.mark.parametrize("options, reason", [
    (Quantization("int4_rtn", group_size=32, exclude=["lm_head"]), "excluded by pattern 'lm_head'"),
    (Quantization("int4_rtn", group_size=32, exclude=[], lm_head="none"), "kept float by quantization.lm_head none"),
    (Quantization("int4_rtn", group_size=32, exclude=[], symmetric=False), "also read by Embedding"),
])
def test_tied_embedding_stays_float_when_the_lm_head_does(options, reason):
    after = QuantizeWeights(options).run(tied_graph())
    assert after.meta.quantization.record["skipped"]["embed"].startswith(reason)
    assert [n.op for n in after.nodes] == ["Embedding", "QuantLinear", "GatherTokens", "Linear"]


def test_lm_head_int8_option_keeps_other_linears_at_4_bits():
    after = QuantizeWeights(Quantization("int4_rtn", group_size=32, exclude=[], lm_head="int8")).run(tied_graph(256))
    quantized = after.meta.quantization.record["quantized"]
    assert quantized["a"]["block_size"] == 32 and quantized["embed"]["block_size"] == INT8_BLOCK
    assert after.nodes[-1].attrs["bits"] == 8
    assert after.nodes[0].attrs == {"bits": 8, "block_size": INT8_BLOCK, "K": 256}


@pytest.mark.parametrize("mode, head_bits", [("int4_rtn", 8), ("int4_gptq", 8), ("int8", 8)])
def test_lm_head_auto_is_8_bits_under_4_bit_schemes(mode, head_bits):
    """The default (auto): a 4-bit scheme's head at 8 bits, shared with the tied embedding; int8 as the others."""
    after = QuantizeWeights(Quantization(mode, group_size=32, exclude=[])).run(tied_graph(256))
    assert after.nodes[-1].attrs["bits"] == head_bits and after.nodes[0].op == "QuantEmbedding"
    assert after.nodes[1].attrs["bits"] == (4 if mode.startswith("int4") else 8)


def test_recipe_rejects_unknown_lm_head_choice():
    with pytest.raises(RecipeError, match="quantization.lm_head: 'int2' is not allowed; allowed: \\['auto', 'same', 'int8', 'none'\\]"):
        load_recipe(base={"model": "m"}, overrides=["quantization.lm_head=int2"])


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tied") / "ckpt", tie_word_embeddings=True,
                           initializer_range=0.1, seed=4)


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tied_int4_engine_matches_transformers_with_its_weights(tied_checkpoint, tmp_path, dtype):
    recipe = load_recipe(base={"model": str(tied_checkpoint)}, overrides=[
        "limits.max_seq_len=64", "limits.max_batch_size=3", "verify.enabled=on", "quantization.mode=int4_rtn",
        "quantization.group_size=32", "quantization.exclude=[]", "quantization.accuracy_level=0",
        f"target.dtype={dtype}"])
    engine = build_engine(recipe, tmp_path / "engine", log=lambda _: None)
    manifest = load_manifest(engine)
    report = manifest["verification"]
    assert report["passed"] and report["float_model"]["greedy_agreement"] >= recipe.verify.min_greedy_agreement
    assert "embed" in manifest["quantization"]["quantized"] and manifest["quantization"]["skipped"] == {}
    model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert "GatherBlockQuantized" in ops and "Gather" in ops  # Gather: the last-token rows, not the table
    floats = [t.name for t in model.graph.initializer if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
              and np.prod(t.dims) >= 512 * 64]
    assert floats == []  # no float copy of the [vocab, hidden] table
    # our own check, independent of the build's: effective weights in transformers, every position
    sequences = [[3, 17, 99, 250, 7, 1], [400, 2, 9]]
    graph = PassManager(pipeline(recipe)).run(trace(tied_checkpoint))
    weights = effective_weights(graph)
    assert "model.embed_tokens.weight" in weights  # the tied table, dequantized: embedding and lm_head
    ours, theirs = engine_logits(engine, sequences), reference_logits(tied_checkpoint, sequences, weights)
    tolerance = 2e-3 if dtype == "float32" else 5e-2
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)) <= tolerance
    if dtype == "float32":
        assert all((a.argmax(-1) == b.argmax(-1)).all() for a, b in zip(ours, theirs))
