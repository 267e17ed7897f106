"""Kernel choice by measurement (`quantization.accuracy_level: auto`): the CPU's instruction set read from its
flags, the kernel table's fastest and pathological choices, the search that moves groups of matmuls to float
activations until the perplexity budget holds (pathological ones last, and said), and a build on a tiny
SmolLM2-shaped GGUF file whose graph levels are the ones the manifest records for each matmul."""
from __future__ import annotations

import json

import pytest

from builder.kernel_choice import Accuracy, Budget, Group, search
from builder.quant.kernels import KernelTable, cpu_flags, cpu_isa
from builder.recipe import RecipeError, load_recipe

XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni amx_int8\n"
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"


def test_the_instruction_set_comes_from_the_cpu_flags():
    assert cpu_isa(cpu_flags(XEON)) == "avx512"
    assert cpu_isa(cpu_flags(EPYC_AVX2)) == "avx2"
    assert cpu_isa(cpu_flags("processor\t: 0\n")) == "other"


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"avx512": {"measured": "here", "us_per_mweight": {
        "4:32:1": 600.0, "4:32:4": 400.0, "8:32:1": 13000.0, "8:32:4": 300.0, "4:128:1": 650.0, "4:128:4": 150.0}}}))
    return KernelTable.load("avx512", ("avx512f",), path)


def test_the_table_gives_the_fastest_and_the_pathological(table):
    assert table.fastest(4, 32) == 4 and table.fastest(8, 32) == 4
    assert table.pathological(8, 32, 1) and table.pathological(8, 32, 0)  # 43x the int8 kernel
    assert not table.pathological(4, 32, 1) and not table.pathological(4, 32, 4)
    assert table.time_us(4, 64, 4, 2_000_000) == 800.0  # block 64 unmeasured: the nearest block of the same bits
    assert "level 1 13000 (43.3x)" in table.describe(8, 32)


def test_without_a_table_the_measured_rule_holds(tmp_path):
    bare = KernelTable.load("avx2", (), tmp_path / "absent.json")
    assert bare.fastest(4, 32) == 4 and bare.fastest(8, 16) == 4
    assert bare.pathological(8, 32, 1) and not bare.pathological(4, 32, 1)
    assert bare.time_us(4, 32, 4, 1000) is None


def _groups():
    return {Group("qkv", 4, 32): ["l0.qkv", "l1.qkv"], Group("down", 4, 32): ["l0.down", "l1.down"],
            Group("lm_head", 8, 32): ["head"]}


LAYOUTS = {name: {"N": 64, "K": 64} for name in ("l0.qkv", "l1.qkv", "l0.down", "l1.down", "head")}
# perplexity change each matmul costs at int8 activations (additive in this stand-in for a measurement)
COSTS = {"l0.qkv": 0.004, "l1.qkv": 0.004, "l0.down": 0.002, "l1.down": 0.002, "head": 0.003}


# top-1 agreement each matmul costs at int8 activations: here the head costs most, qkv least
TOP1 = {"l0.qkv": 0.002, "l1.qkv": 0.002, "l0.down": 0.005, "l1.down": 0.005, "head": 0.02}


def _cost(calls):
    def cost(levels, kinds=frozenset()):
        calls.append(dict(levels))
        return Accuracy(sum(c for name, c in COSTS.items() if levels[name] == 4),
                        1 - sum(c for name, c in TOP1.items() if levels[name] == 4))
    return cost


def test_within_budget_every_matmul_keeps_its_fastest_kernel(table):
    calls = []
    found = search(_groups(), dict.fromkeys(COSTS, 4), _cost(calls), Budget(0.02), table, LAYOUTS, log=lambda _: None)
    assert found.levels == dict.fromkeys(COSTS, 4) and not found.moved and len(calls) == 1
    assert found.accuracy.change == pytest.approx(0.015)


def test_over_budget_the_group_that_buys_most_moves_first_and_the_pathological_head_stays(table):
    found = search(_groups(), dict.fromkeys(COSTS, 4), _cost([]), Budget(0.01), table, LAYOUTS, log=lambda _: None)
    assert found.moved == [Group("qkv", 4, 32)] and not found.forced  # 0.008 of 0.015 for the same table time
    assert found.levels == {"l0.qkv": 1, "l1.qkv": 1, "l0.down": 4, "l1.down": 4, "head": 4}
    assert found.accuracy.change == pytest.approx(0.007)
    assert [step for step, _ in found.trail] == ["table's fastest", "+ qkv (4-bit, block 32) at float activations"]


def test_a_budget_only_the_pathological_kernel_meets_forces_it_and_says_so(table):
    found = search(_groups(), dict.fromkeys(COSTS, 4), _cost([]), Budget(0.001), table, LAYOUTS, log=lambda _: None)
    assert found.moved == [Group("qkv", 4, 32), Group("down", 4, 32)]
    assert found.forced == [Group("lm_head", 8, 32)] and found.accuracy.change == 0.0


def test_a_top1_budget_moves_the_group_that_buys_agreement_not_the_one_that_buys_perplexity(table):
    """Perplexity within its budget, top-1 agreement (0.966) not: down buys the most agreement per table time
    (qkv the most perplexity), so down moves; without the top-1 budget nothing moves."""
    assert not search(_groups(), dict.fromkeys(COSTS, 4), _cost([]), Budget(0.02), table, LAYOUTS,
                      log=lambda _: None).moved
    found = search(_groups(), dict.fromkeys(COSTS, 4), _cost([]), Budget(0.02, top1=0.025), table, LAYOUTS,
                   log=lambda _: None)
    assert found.moved == [Group("down", 4, 32)] and not found.forced
    assert found.accuracy.top1 == pytest.approx(0.976) and found.accuracy.change == pytest.approx(0.011)
    assert [a.top1 for _, a in found.trail] == pytest.approx([0.966, 0.976])


def test_budget_holds_on_both_and_ranks_by_the_larger_overshoot():
    budget = Budget(0.01, top1=0.02)
    assert budget.holds(Accuracy(0.01, 0.985)) and not budget.holds(Accuracy(0.011, 0.99))
    assert not budget.holds(Accuracy(0.0, 0.97))
    assert budget.excess(Accuracy(0.005, 0.96)) == pytest.approx(2.0)  # top-1 overshoots 2x, perplexity 0.5x
    assert Budget(0.01).excess(Accuracy(0.005, 0.5)) == pytest.approx(0.5)  # top-1 not a criterion


@pytest.mark.parametrize("value,message", [
    ("quantization.accuracy_level=fast", r"'fast' is not 'auto', a level \[0, 1, 2, 3, 4\]"),
    ("quantization.accuracy_budget=1.5", r"accuracy_budget: 1.5 is not in \[0, 1\)"),
    ("quantization.accuracy_top1_budget=-0.1", r"accuracy_top1_budget: -0.1 is not in \[0, 1\)"),
    ("quantization.accuracy_kl_budget=2", r"accuracy_kl_budget: 2.0 is not in \[0, 1\) \(the mean KL divergence"),
    ("quantization.activation_block=12", r"activation_block: 12 is not one of \[16, 32, 64, 128\]"),
    ("quantization.activation_block={qkv: 24}", r"activation_block.qkv: 24 is not one of"),
    ("quantization.activation_block={qkv: true}", r"activation_block.qkv: expected int, got bool"),
    ("quantization.activation_block=fast", r"activation_block: 'fast' is not 'auto', a block \[16, 32, 64, 128\]")])
def test_bad_kernel_settings_are_recipe_errors(value, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(base={"model": "x"}, overrides=[value])


def test_auto_build_records_each_matmul_and_the_graph_runs_it(tmp_path, monkeypatch):
    """A tiny SmolLM2-shaped GGUF (Q4_1 linears, Q8_0 tied head), verified at build: every quantized matmul has
    its choice and why in the manifest, the graph's accuracy_level attributes are those choices, and the 8-bit
    head is not at float activations unless the record says it was forced."""
    pytest.importorskip("gguf")
    from tests.builder.gguf_files import write_llama
    from tests.builder.test_accuracy_levels import SMOLLM2_TYPES, _levels_by_kind
    from tests.builder.test_gguf import _build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = write_llama(tmp_path / "m.gguf", SMOLLM2_TYPES, hidden=256, inter=512, heads=4, kv_heads=2)
    record = _build(model, tmp_path / "engine", **{"quantization.accuracy_level": "auto",
                                                     "verify.enabled": "on"})["quantization"]
    matmuls = record["matmuls"]
    assert set(matmuls) == set(record["quantized"])
    assert all(choice["why"] for choice in matmuls.values())
    levels = _levels_by_kind(tmp_path / "engine")
    assert levels == {kind: {level} for kind, level in record["accuracy_levels"].items()}
    choice = record["kernel_choice"]
    assert choice["isa"] == cpu_isa(cpu_flags()) and choice["windows"] >= 1
    assert choice["within_budget"] == (choice["perplexity_change"] <= choice["budget"])
    assert choice["top1_budget"] is None and 0 < choice["top1_agreement"] <= 1
    assert all("top1_agreement" in step for step in choice["steps"])
    assert matmuls["embed"]["bits"] == 8
    assert (matmuls["embed"]["level"] == 4) != ("lm_head (8-bit, block 32)" in choice["forced_pathological"])


def test_auto_without_a_float_reference_keeps_the_table_choice_and_says_it_was_not_measured(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from tests.builder.gguf_files import write_llama
    from tests.builder.test_accuracy_levels import SMOLLM2_TYPES
    from tests.builder.test_gguf import _build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = write_llama(tmp_path / "m.gguf", SMOLLM2_TYPES, hidden=256, inter=512, heads=4, kv_heads=2)
    record = _build(model, tmp_path / "engine", **{"quantization.accuracy_level": "auto"})["quantization"]
    assert record["kernel_choice"] == {"measured": False}
    table = KernelTable.for_this_cpu()
    assert all(c["level"] == table.fastest(c["bits"], c["block"]) for c in record["matmuls"].values())
