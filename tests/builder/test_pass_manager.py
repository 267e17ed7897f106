"""The pass manager (failures, verification, disabled passes, dumps) and the literal pipeline.

Split from the former tests/test_ir_and_passes.py; graphs and the numpy interpreter of the IR
are in tests/graph_helpers.py."""
from __future__ import annotations

import pytest

from builder.ir import Graph, Node
from builder.pass_manager import Disabled, Pass, PassError, PassManager, Phase
from builder.passes.fold_rotary import FoldRotary
from builder.passes.fuse_gate_up import FuseGateUp
from builder.pipeline import pipeline
from builder.recipe import load_recipe
from builder.verifier import VerifyError
from graph_helpers import assert_same_outputs, decoder, decoder_feeds, ops


class Boom(Pass):
    name = "boom"

    def run(self, graph: Graph) -> Graph:
        raise RuntimeError("kaboom")


class Breaks(Pass):
    name = "breaks_graph"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        g.nodes.append(Node("Frobnicate", [], ["f"], {}, "frob"))
        return g


def test_pass_manager_wraps_failure_with_pass_and_history():
    manager = PassManager([Phase("fusion", [FoldRotary(), Disabled("fuse_qkv")]), Phase("late", [Boom()])])
    with pytest.raises(PassError) as info:
        manager.run(decoder())
    message = str(info.value)
    assert "pass 'boom' (phase late) failed: kaboom" in message
    assert "passes run before it: ['fold_rotary', 'fuse_qkv']" in message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_pass_manager_first_pass_failure_and_verifier_failure():
    with pytest.raises(PassError, match="pass 'boom' .*passes run before it: none"):
        PassManager([Phase("p", [Boom()])]).run(decoder())
    with pytest.raises(PassError, match="pass 'breaks_graph' \\(phase p\\) failed: .*unknown op 'Frobnicate'") \
            as info:
        PassManager([Phase("p", [FoldRotary(), Breaks()])]).run(decoder())
    assert isinstance(info.value.__cause__, VerifyError)


def test_pass_manager_verifies_input_graph():
    g = decoder()
    g.nodes.reverse()
    with pytest.raises(VerifyError, match="used before it is defined"):
        PassManager([Phase("p", [])]).run(g)


def test_disabled_pass_is_a_noop_listed_in_timings():
    g = decoder()
    disabled = Disabled("fuse_qkv")
    assert disabled.run(g) is g and disabled.name == "fuse_qkv" and disabled.why == "disabled by the recipe"
    manager = PassManager([Phase("fusion", [FoldRotary(), disabled, FuseGateUp()])])
    out = manager.run(g)
    assert [(t.phase, t.name, t.disabled) for t in manager.timings] == [
        ("fusion", "fold_rotary", False), ("fusion", "fuse_qkv", True), ("fusion", "fuse_gate_up", False)]
    assert all(t.seconds >= 0 for t in manager.timings)
    assert [t.nodes_after for t in manager.timings] == [len(g.nodes) - 4, len(g.nodes) - 4, len(out.nodes)]
    assert "Attention" in ops(out) and all(n.attrs["packed_qkv"] is False for n in out.nodes_of("Attention"))


def test_dump_dir_gets_before_and_after_each_phase(tmp_path):
    recipe = load_recipe(base={"model": "unused"}, overrides=["limits.max_seq_len=64", "limits.max_batch_size=2"])
    manager = PassManager(pipeline(recipe), tmp_path / "ir")
    out = manager.run(decoder())
    names = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert names == sorted(f"{i:02d}-{when}-{phase}.ir" for i, phase in
                           enumerate(["fusion", "adapters", "parallel", "quantization", "layout", "cleanup"])
                           for when in ("before", "after"))
    before = (tmp_path / "ir" / "00-before-fusion.ir").read_text()
    after = (tmp_path / "ir" / "00-after-fusion.ir").read_text()
    assert "Rotary(" in before and "concat(" not in before
    assert "concat(" in after and "Rotary(" not in after and "SkipRMSNorm(" in after
    assert "meta kv_cache" in (tmp_path / "ir" / "04-after-layout.ir").read_text()
    assert (tmp_path / "ir" / "05-after-cleanup.ir").read_text() == out.text()
    assert out.meta.kv_cache.slots == 2


def test_pipeline_lists_every_pass_and_disables_by_recipe():
    recipe = load_recipe(base={"model": "m"}, overrides=["passes.fuse_qkv=false", "passes.fuse_add_rmsnorm=false",
                                                                "limits.max_seq_len=64", "sampling_head.enabled=false"])
    phases = pipeline(recipe)
    assert [p.name for p in phases] == ["fusion", "adapters", "parallel", "quantization", "layout", "cleanup"]
    listed = [(p.name, isinstance(p, Disabled)) for phase in phases for p in phase.passes]
    assert listed == [("fold_rotary", False), ("permute_activations", False), ("fuse_qkv", True), ("fuse_gate_up", False),
                      ("fuse_add_rmsnorm", True), ("append_sampling_head", True), ("append_hidden_output", True), ("add_lora", True), ("shard_tensor_parallel", True),
                      ("search_awq_scales", True), ("solve_gptq", True),
                      ("quantize_weights", True), ("add_block_minimums", False), ("plan_kv_cache", False), ("calibrate_kv_scales", True),
                      ("plan_cuda_graphs", True),
                      ("remove_dead_nodes", False)]
    out = PassManager(phases).run(decoder())
    assert "SkipRMSNorm" not in ops(out) and "GatedActivation" in ops(out)
    assert all(not n.attrs["packed_qkv"] and n.attrs["rotary"] for n in out.nodes_of("Attention"))
    assert_same_outputs(decoder(), out, decoder_feeds())


class NeedsQKV(Pass):
    name, requires = "needs_qkv", ("fuse_qkv",)

    def run(self, graph: Graph) -> Graph:
        return graph


def test_a_pass_requirement_is_checked_before_any_pass_runs():
    ran = []

    class Records(Pass):
        name = "records"

        def run(self, graph: Graph) -> Graph:
            ran.append(self.name)
            return graph

    disabled = PassManager([Phase("fusion", [Records(), Disabled("fuse_qkv", "passes.fuse_qkv is false")]),
                            Phase("late", [NeedsQKV()])])
    with pytest.raises(PassError, match=r"pass 'needs_qkv' \(phase late\) requires 'fuse_qkv', which is disabled "
                                        r"\(passes.fuse_qkv is false\)"):
        disabled.run(decoder())
    with pytest.raises(PassError, match="requires 'fuse_qkv', which does not run before it"):
        PassManager([Phase("late", [NeedsQKV()]), Phase("fusion", [FoldRotary()])]).run(decoder())
    assert ran == []  # refused up front, not after the passes before it ran
    PassManager([Phase("p", [Disabled("needs_qkv")])]).run(decoder())  # a disabled pass requires nothing


def test_a_tensor_parallel_pipeline_shards_without_the_fusions():
    """shard_tensor_parallel needs neither packed projection: with both fusions off each rank keeps half of
    q, k, v, gate and up, and sums o_proj and down_proj over the ranks."""
    recipe = load_recipe(base={"model": "m"}, overrides=["passes.fuse_gate_up=false", "passes.fuse_qkv=false",
                                                         "limits.max_seq_len=64", "parallel.tensor_parallel=2"])
    whole, out = decoder(), PassManager(pipeline(recipe, rank=1)).run(decoder())
    assert ops(out).count("AllReduce") == 2 * 2  # o_proj and down_proj of 2 layers
    for name in ("layers.0.q", "layers.0.k", "layers.0.v", "layers.0.gate", "layers.0.up"):
        assert out.values[name].shape[0] * 2 == whole.values[name].shape[0], name
