"""Int8 activations in smaller blocks (issue 47): a MatMulNBits weight re-blocked exactly (builder/quant/weights.py
`reblock`: codes as stored, each scale and zero point repeated), the block-minimum term kept at the file's block,
`quantization.activation_block` in a build, the kernel choice's re-block step (picked under a top-1 budget, recorded
in the manifest, the engine written again to match). The recipe's errors for bad settings: test_kernel_choice.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from builder.kernel_choice import SMALL_BLOCK, Accuracy, Budget, Group, search
from builder.quant.kernels import KernelTable
from builder.quant.schemes import QuantizedArrays, dequantize, quantize
from builder.quant.weights import Quantizer, reblock
from builder.weights import WeightSource
from tests.builder.test_accuracy_levels import _cache, smollm2_like  # noqa: F401 (fixtures: a SmolLM2-shaped GGUF)
from tests.builder.test_add_block_minimums import gguf_weight
from tests.builder.test_gguf import _build


class Dense(WeightSource):
    def __init__(self, value: np.ndarray):
        self.value, self.shape, self.dtype = value, value.shape, "float32"

    def materialize(self) -> np.ndarray:
        return self.value


def _parts(quantizer: Quantizer) -> QuantizedArrays:
    return QuantizedArrays(*(quantizer.take(p) if p in quantizer.parts() else None
                             for p in ("q", "scales", "zero_points")))


CASES = [  # (name, bits, block, symmetric, K): GGUF files' own arrays and round-to-nearest ones, a padded last block
    ("Q4_1", 4, 32, None, 256), ("Q4_0", 4, 32, None, 256), ("Q8_0", 8, 32, None, 256),
    ("rtn4_zp", 4, 32, False, 72), ("rtn4_sym", 4, 128, True, 200), ("rtn8_zp", 8, 64, False, 96)]


def _quantizers(case, run_block: int) -> tuple[Quantizer, Quantizer]:
    name, bits, block, symmetric, k = case
    if symmetric is None:
        source = gguf_weight(name, 48, 3)  # K 256
        symmetric = source.symmetric
    else:
        source = Dense(np.random.default_rng(5).standard_normal((48, k)).astype(np.float32))
    return Quantizer(source, bits, block, symmetric), Quantizer(source, bits, block, symmetric, run_block)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_reblocked_weight_dequantizes_to_the_same_values_bit_for_bit(case):
    _, bits, block, _, k = case
    stored, smaller = _quantizers(case, SMALL_BLOCK)
    a, b = _parts(stored), _parts(smaller)
    assert b.q.shape == smaller.shape("q") and b.scales.shape == smaller.shape("scales")
    assert b.scales.shape[1] == -(-k // SMALL_BLOCK)  # a padded last block past K dropped
    np.testing.assert_array_equal(dequantize(b, bits, SMALL_BLOCK, k), dequantize(a, bits, block, k))
    kept = b.q[0].size  # the codes' bytes as stored, less a padded last block's tail past K
    np.testing.assert_array_equal(b.q.reshape(48, -1), a.q.reshape(48, -1)[:, :kept])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_reblocked_matmul_nbits_computes_the_same_at_float_activations(case):
    """ONNX Runtime's MatMulNBits at accuracy level 1 (float activations) on the stored blocks and on the
    re-blocked ones: the same outputs."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    _, bits, block, _, k = case
    stored, smaller = _quantizers(case, SMALL_BLOCK)
    x = np.random.default_rng(1).standard_normal((3, k)).astype(np.float32)
    outputs = []
    for arrays, b in ((_parts(stored), block), (_parts(smaller), SMALL_BLOCK)):
        weights = [numpy_helper.from_array(a, n) for a, n in zip(arrays, ("q", "s", "zp")) if a is not None]
        node = helper.make_node("MatMulNBits", ["x"] + [w.name for w in weights], ["y"], domain="com.microsoft",
                                K=k, N=48, bits=bits, block_size=b, accuracy_level=1)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 48])], weights)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        outputs.append(session.run(None, {"x": x})[0])
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)


def test_a_block_that_does_not_divide_the_stored_one_is_refused():
    arrays = quantize(np.ones((2, 64), np.float32), 4, 32)
    with pytest.raises(ValueError, match="cannot be re-blocked exactly to 64"):
        reblock(arrays, 4, 32, 64, 64)


def test_the_block_minimum_term_stays_in_the_files_blocks():
    """A Q4_1 linear run in blocks of 16: AddBlockMinimums sums x per 32 (the file's block) with one minimum per
    32, and the graph computes the file's weight."""
    from builder.ir import Graph
    from builder.passes.add_block_minimums import AddBlockMinimums
    from builder.quant.weights import QuantizedWeight
    from builder.verifier import verify

    source = gguf_weight("Q4_1", 64, 0)
    g = Graph("m")
    x = g.add_input("x", ("batch", 256), "float32")
    quantizer = Quantizer(source, 4, 32, source.symmetric, SMALL_BLOCK)
    inputs = [x] + [g.add_weight(f"l.{p}", QuantizedWeight(quantizer, p)) for p in quantizer.parts()]
    y = g.make("QuantLinear", inputs, ("batch", 64), "float32", bits=4, block_size=SMALL_BLOCK, K=256, N=64,
               accuracy_level=4)
    g.add_output(y)
    after = AddBlockMinimums().run(g)
    verify(after)
    block_sum = next(n for n in after.nodes if n.op == "BlockSum")
    assert block_sum.attrs["block"] == 32 and after.weights["l.block_minimums"].shape == (64, 256 // 32)
    xs = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    w = dequantize(_parts(Quantizer(source, 4, 32, source.symmetric, SMALL_BLOCK)), 4, SMALL_BLOCK, 256)
    got = xs @ w.T + xs.reshape(3, -1, 32).sum(-1) @ after.weights["l.block_minimums"].materialize().T
    np.testing.assert_allclose(got, xs @ source.materialize().T, rtol=1e-4, atol=1e-4)


# -- the kernel choice's step ------------------------------------------------------------------------------------

def _table(tmp_path) -> KernelTable:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"avx512": {"measured": "here", "us_per_mweight": {
        "4:32:1": 600.0, "4:32:4": 400.0, "4:16:4": 480.0, "8:32:1": 13000.0, "8:32:4": 300.0, "8:16:4": 380.0}}}))
    return KernelTable.load("avx512", ("avx512f",), path)


GROUPS = {Group("qkv", 4, 32): ["l0.qkv", "l1.qkv"], Group("o", 4, 32): ["l0.o", "l1.o"],
          Group("lm_head", 8, 32): ["head"]}
LAYOUTS = {name: {"N": 64, "K": 64} for names in GROUPS.values() for name in names}
KIND = {name: g.kind for g, names in GROUPS.items() for name in names}
# top-1 agreement each matmul costs at int8 activations in blocks of 32, and in blocks of 16
TOP1 = {"l0.qkv": 0.006, "l1.qkv": 0.006, "l0.o": 0.003, "l1.o": 0.003, "head": 0.008}
TOP1_16 = {"l0.qkv": 0.002, "l1.qkv": 0.002, "l0.o": 0.003, "l1.o": 0.003, "head": 0.003}


def _cost(levels: dict[str, int], kinds: frozenset[str]) -> Accuracy:
    lost = sum((TOP1_16 if KIND[n] in kinds else TOP1)[n] for n, level in levels.items() if level == 4)
    return Accuracy(0.001, 1 - lost)


def test_under_a_top1_budget_the_search_reblocks_before_float_activations(tmp_path):
    """Agreement 0.974, budget >= 0.98: the head in blocks of 16 buys the most per table microsecond, then qkv (each
    for a fraction of float's table time; o in blocks of 16 buys nothing), so the search re-blocks those kinds and
    moves nothing to float."""
    found = search(GROUPS, dict.fromkeys(TOP1, 4), _cost, Budget(0.01, top1=0.02), _table(tmp_path), LAYOUTS,
                   log=lambda _: None)
    assert found.reblocked == {"qkv", "lm_head"} and not found.moved and not found.forced
    assert found.blocks == {"l0.qkv": 16, "l1.qkv": 16, "head": 16}
    assert found.levels == dict.fromkeys(TOP1, 4) and found.accuracy.top1 == pytest.approx(0.987)
    assert [step for step, _ in found.trail[1:]] == [
        "+ lm_head at int8 activations in blocks of 16", "+ qkv at int8 activations in blocks of 16"]


def test_without_block_steps_the_same_budget_moves_groups_to_float(tmp_path):
    found = search(GROUPS, dict.fromkeys(TOP1, 4), _cost, Budget(0.01, top1=0.02), _table(tmp_path), LAYOUTS,
                   log=lambda _: None, blocks=False)
    assert not found.reblocked and found.moved == [Group("qkv", 4, 32)] and not found.blocks
    assert found.accuracy.top1 == pytest.approx(0.986)


@pytest.mark.e2e
def test_kinds_the_recipe_reblocked_are_not_offered_again(tmp_path):
    """With the head re-blocked by the recipe, the search's steps are qkv's and o's (its cost function sees the
    recipe's kinds as part of the engine on disk, not as a step)."""
    steps = []

    def cost(levels, kinds):
        steps.append(kinds)
        return _cost(levels, kinds | {"lm_head"})

    found = search(GROUPS, dict.fromkeys(TOP1, 4), cost, Budget(0.01, top1=0.02), _table(tmp_path), LAYOUTS,
                   log=lambda _: None, fixed=frozenset({"lm_head"}))
    assert found.reblocked == {"qkv"} and found.blocks == {"l0.qkv": 16, "l1.qkv": 16}
    assert all("lm_head" not in kinds for kinds in steps) and frozenset({"o"}) in steps


def test_the_auto_build_writes_and_records_the_reblock_the_search_chose(tmp_path, monkeypatch, smollm2_like):
    """A tiny SmolLM2-shaped GGUF (Q4_1 linears, Q8_0 tied head), verified at build, the search replaced by one
    that re-blocks qkv and the head: the engine's graph runs those in blocks of 16 (the tied embedding's gather
    too), the manifest says so per matmul, and verification passes on that engine."""
    import onnx

    import builder.kernel_choice as kernel_choice

    real = kernel_choice.search

    def reblocking(groups, levels, cost, budget, table, layouts, log, blocks=True, fixed=frozenset()):
        found = real(groups, levels, cost, kernel_choice.Budget(1.0), table, layouts, log, blocks, fixed)
        found.reblocked = frozenset({"qkv", "lm_head"})
        found.blocks = {n: SMALL_BLOCK for g, names in groups.items() if g.kind in found.reblocked for n in names}
        found.accuracy = cost(found.levels, found.reblocked)
        return found

    monkeypatch.setattr(kernel_choice, "search", reblocking)
    manifest = _build(smollm2_like, tmp_path / "engine",
                      **{"quantization.accuracy_level": "auto", "verify.enabled": "on"})
    record = manifest["quantization"]
    assert manifest["verification"]["passed"]
    assert record["kernel_choice"]["activation_block"] == {"lm_head": 16, "qkv": 16}
    graph = onnx.load(str(tmp_path / "engine" / "model.onnx"), load_external_data=False).graph
    blocks = {n.input[1].removesuffix(".q"): a.i for n in graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "block_size"}
    for name, choice in record["matmuls"].items():
        reblocked = choice["kind"] in ("qkv", "lm_head")
        assert blocks[name] == (16 if reblocked else 32), name
        assert choice.get("activation_block") == (16 if reblocked else None), name
        assert record["quantized"][name]["block_size"] == blocks[name]
        assert ("blocks of 16" in choice["why"]) == reblocked
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    assert {a.name: a.i for a in gather.attribute}["block_size"] == 16
    sums = [n for n in graph.node if n.op_type == "Reshape" and "block_sums" in n.output[0]]
    assert sums, "the Q4_1 minimum terms are there"


def test_an_explicit_activation_block_reblocks_the_kinds_at_int8_activations_only(tmp_path, smollm2_like):
    from builder.pass_manager import PassError

    model = smollm2_like
    record = _build(model, tmp_path / "e", **{"quantization.accuracy_level": "{default: 4, o: 1}",
                                               "quantization.activation_block": "{qkv: 16, o: 16}"})["quantization"]
    quantized = record["quantized"]
    assert quantized["layers.0.qkv"] == {"N": 512, "K": 256, "block_size": 16, "stored_block": 32}
    assert quantized["layers.0.o"]["block_size"] == 32  # float activations: nothing to round
    with pytest.raises(PassError, match="activation_block: 'mlp' is not a layer kind of this model's quantized "
                                        "matmuls; allowed keys: default, down, gate_up, lm_head, o, qkv"):
        _build(model, tmp_path / "e2", **{"quantization.accuracy_level": 4,
                                          "quantization.activation_block": "{mlp: 16}"})
