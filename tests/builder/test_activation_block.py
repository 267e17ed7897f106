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
    import builder.kernel_choice as kernel_choice

    real = kernel_choice.search

    def reblocking(groups, levels, cost, budget, table, layouts, log, blocks=True, fixed=frozenset(),
                   auto_blocks=False):
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
    graph = _assert_qkv_and_head_reblocked(tmp_path / "engine", record, "blocks of 16")
    sums = [n for n in graph.node if n.op_type == "Reshape" and "block_sums" in n.output[0]]
    assert sums, "the Q4_1 minimum terms are there"


def _assert_qkv_and_head_reblocked(engine, record: dict, why: str):
    """The graph runs qkv and the head (the tied gather too) in blocks of 16 and the rest in 32, and each matmul's
    record says so, `why` in the why of exactly the re-blocked ones. Returns the graph."""
    import onnx

    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False).graph
    blocks = {n.input[1].removesuffix(".q"): a.i for n in graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "block_size"}
    for name, choice in record["matmuls"].items():
        reblocked = choice["kind"] in ("qkv", "lm_head")
        assert blocks[name] == (16 if reblocked else 32), name
        assert choice.get("activation_block") == (16 if reblocked else None), name
        assert record["quantized"][name]["block_size"] == blocks[name]
        assert (why in choice["why"]) == reblocked, name
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    assert {a.name: a.i for a in gather.attribute}["block_size"] == 16
    return graph


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


# -- activation_block: auto ----------------------------------------------------------------------------------------

# each kind's share of the int8 rounding's KL its re-block removes, and the noise at each position (o's gain is
# within it); by _table's figures the re-block of qkv or o adds 8% of the matmuls' time, the head's 4%
KL_REMOVED = {"qkv": 0.30, "o": 0.004, "lm_head": 0.02}


def _kl_cost(calls: list, removed: dict[str, float] = KL_REMOVED):
    rng = np.random.default_rng(0)
    base, noise = 0.01 * (1 + rng.random(1536)), {kind: 0.002 * rng.standard_normal(1536) for kind in removed}

    def cost(levels, kinds=frozenset()):
        calls.append(kinds)
        kl = base * (1 - sum(removed[k] for k in kinds)) + sum(noise[k] for k in kinds)
        return Accuracy(0.001, 0.97, float(kl.mean()), kl)
    return cost


def test_auto_reblocks_a_kind_whose_kl_share_beats_its_time_share_and_stands_clear_of_the_noise(tmp_path):
    """qkv removes 30% of the rounding for 8% of the table time: taken; the head removes 2% for 4%, o 0.4%
    within the positions' noise: neither. Within the perplexity budget nothing else moves, and the trials, the
    combined measurement and the blocks are what the build records."""
    calls = []
    found = search(GROUPS, dict.fromkeys(TOP1, 4), _kl_cost(calls), Budget(0.01), _table(tmp_path), LAYOUTS,
                   log=lambda _: None, auto_blocks=True)
    trials = {t.kind: t for t in found.trials}
    assert set(trials) == {"qkv", "o", "lm_head"}
    assert trials["qkv"].worth and trials["qkv"].kl_share == pytest.approx(0.30, abs=0.01) and trials["qkv"].z > 10
    assert trials["qkv"].time_share == pytest.approx(2 * 64 * 64 * (480 - 400) / 1e6 / _total_us(), rel=1e-6)
    assert not trials["lm_head"].worth and trials["lm_head"].kl_share < trials["lm_head"].time_share
    assert not trials["o"].worth and abs(trials["o"].z) < 2
    assert found.reblocked == {"qkv"} and found.blocks == {"l0.qkv": 16, "l1.qkv": 16}
    assert found.accuracy.kl == pytest.approx(0.7 * found.trail[0][1].kl, rel=0.01)
    assert [step for step, _ in found.trail] == ["table's fastest", "+ qkv in blocks of 16 (activation_block auto)"]
    assert calls == [frozenset(), {"qkv"}, {"o"}, {"lm_head"}, {"qkv"}] and not found.moved


def test_with_a_kl_budget_auto_takes_the_most_worth_first_and_stops_inside_it(tmp_path):
    """qkv (30% for 8%) and the head (10% for 4%) are both worth their time, qkv the more: without a KL budget both
    are taken, qkv first; with a budget 0.75x the rounding's KL, qkv alone brings it inside and the head is left;
    with a budget the table's fastest already holds, nothing is tried."""
    removed, levels, table = {"qkv": 0.30, "o": 0.004, "lm_head": 0.10}, dict.fromkeys(TOP1, 4), _table(tmp_path)
    found = search(GROUPS, levels, _kl_cost([], removed), Budget(0.01), table, LAYOUTS, log=lambda _: None,
                   auto_blocks=True)
    assert found.reblocked == {"qkv", "lm_head"} and [step for step, _ in found.trail[1:]] == [
        "+ qkv in blocks of 16 (activation_block auto)", "+ lm_head in blocks of 16 (activation_block auto)"]
    first = found.trail[0][1].kl
    found = search(GROUPS, levels, _kl_cost([], removed), Budget(0.01, kl=0.75 * first), table, LAYOUTS,
                   log=lambda _: None, auto_blocks=True)
    assert found.reblocked == {"qkv"} and found.accuracy.kl <= 0.75 * first and {t.kind for t in found.trials if
                                                                                  t.worth} == {"qkv", "lm_head"}
    calls = []
    found = search(GROUPS, levels, _kl_cost(calls, removed), Budget(0.01, kl=first), table, LAYOUTS,
                   log=lambda _: None, auto_blocks=True)
    assert not found.reblocked and not found.trials and calls == [frozenset()]


def test_a_kl_budget_holds_and_ranks_like_the_others():
    budget = Budget(0.01, kl=0.003)
    assert budget.holds(Accuracy(0.0, 0.9, 0.003)) and not budget.holds(Accuracy(0.0, 1.0, 0.0031))
    assert budget.excess(Accuracy(0.005, 0.9, 0.006)) == pytest.approx(2.0) and str(budget) == "1%, KL <= 0.003"


def _total_us() -> float:  # _table's time of GROUPS at level 4: four 4-bit 64 x 64 matmuls and the 8-bit head
    return (4 * 400 + 300) * 64 * 64 / 1e6


def test_auto_takes_nothing_without_a_table_to_price_it_and_never_offers_the_recipes_kinds(tmp_path):
    calls, lines = [], []
    bare = KernelTable.load("avx2", (), tmp_path / "absent.json")
    found = search(GROUPS, dict.fromkeys(TOP1, 4), _kl_cost(calls), Budget(0.01), bare, LAYOUTS,
                   log=lines.append, auto_blocks=True)
    assert not found.trials and not found.reblocked and calls == [frozenset()]
    assert any("no kernel table for avx2 to price a re-block" in line for line in lines)
    calls.clear()
    found = search(GROUPS, dict.fromkeys(TOP1, 4), _kl_cost(calls), Budget(0.01), _table(tmp_path), LAYOUTS,
                   log=lambda _: None, auto_blocks=True, fixed=frozenset({"qkv"}))
    assert {t.kind for t in found.trials} == {"o", "lm_head"} and not found.reblocked


def test_the_auto_build_measures_every_kind_and_writes_what_it_took(tmp_path, monkeypatch, smollm2_like):
    """`activation_block: auto` on a tiny SmolLM2-shaped GGUF, verified at build: every re-blockable kind is tried
    against float (its KL share, z and time share in the manifest). Random weights give flat logits, a KL of ~0 and
    nothing worth taking, so the decision is made to take qkv and the head: the graph, the gather and each matmul's
    record then say exactly those, and verification passes on that engine."""
    import builder.kernel_choice as kernel_choice

    monkeypatch.setattr(kernel_choice.BlockTrial, "worth", property(lambda t: t.kind in ("qkv", "lm_head")))
    manifest = _build(smollm2_like, tmp_path / "engine", **{"quantization.accuracy_level": "auto",
                                                             "quantization.activation_block": "auto",
                                                             "verify.enabled": "on"})
    record, choice = manifest["quantization"], manifest["quantization"]["kernel_choice"]
    assert manifest["verification"]["passed"]
    trials = {t["kind"]: t for t in choice["activation_block_trials"]}
    assert set(trials) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert all(np.isfinite(t["kl_share"]) and 0 < t["time_share"] < 1 for t in trials.values())
    assert {kind for kind, t in trials.items() if t["taken"]} == {"qkv", "lm_head"}
    assert choice["activation_block"] == {"lm_head": 16, "qkv": 16}
    assert {step["step"] for step in choice["steps"][-2:]} == {"+ lm_head in blocks of 16 (activation_block auto)",
                                                               "+ qkv in blocks of 16 (activation_block auto)"}
    assert all(step["kl"] >= -1e-9 for step in choice["steps"])
    _assert_qkv_and_head_reblocked(tmp_path / "engine", record, "activation_block auto")


def test_auto_without_a_float_reference_or_with_explicit_levels_reblocks_nothing(tmp_path, smollm2_like):
    record = _build(smollm2_like, tmp_path / "e", **{"quantization.accuracy_level": "auto",
                                                      "quantization.activation_block": "auto"})["quantization"]
    assert record["kernel_choice"] == {"measured": False}
    assert all(q["block_size"] == 32 for q in record["quantized"].values())
    record = _build(smollm2_like, tmp_path / "e2", **{"quantization.accuracy_level": "{default: 1, lm_head: 4}",
                                                       "quantization.activation_block": "auto"})["quantization"]
    assert "kernel_choice" not in record and all(q["block_size"] == 32 for q in record["quantized"].values())
