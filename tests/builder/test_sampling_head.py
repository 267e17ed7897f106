"""The sampling head (ArgMax / TopK appended to the engine graph) and the CUDA-graph capture points:
recipe sections, Before/After pass tests on small inline IR, the pipeline listing, the manifest, and
the built engine's ArgMax / TopK outputs against numpy over the engine's own logits."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from builder.ir import Graph
from builder.pass_manager import Disabled, PassError, PassManager, Phase
from builder.passes.append_sampling_head import AppendSamplingHead, SamplingHeadError
from builder.passes.plan_cuda_graphs import PlanCudaGraphs
from builder.pipeline import pipeline
from builder.recipe import RecipeError, SamplingHeadOptions, load_recipe
from builder.weights import ArrayWeight
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.types import CudaGraphs, SamplingHead
from runtime.model.rotary import rope_tables

VOCAB, HIDDEN = 11, 8


def head_graph(vocab: int = VOCAB, hidden: int = HIDDEN, tied: bool = False, inner: bool = False) -> Graph:
    """ids -> Embedding -> [Linear(a)] -> GatherTokens -> Linear(lm_head, or embed when tied) -> logits."""
    g = Graph("head")
    rng = np.random.default_rng(0)
    ids = g.add_input("input_ids", ("batch", "seq"), "int64")
    index = g.add_input("logits_index", ("num_logits",), "int64")
    rows = {"embed": vocab, "a": hidden, "lm_head": vocab}
    for name in ["embed"] + (["a"] if inner else []) + ([] if tied else ["lm_head"]):
        g.add_weight(name, ArrayWeight(rng.standard_normal((rows[name], hidden)).astype(np.float32), name))
    x = g.make("Embedding", [ids, "embed"], ("batch", "seq", hidden), "float32")
    if inner:
        x = g.make("Linear", [x, "a"], ("batch", "seq", hidden), "float32")
    x = g.make("GatherTokens", [x, index], ("num_logits", hidden), "float32")
    g.make("Linear", [x, "embed" if tied else "lm_head"], ("num_logits", vocab), "float32", out="logits")
    g.add_output("logits")
    return g


# -- recipe ------------------------------------------------------------------------------------
def test_recipe_sections_default_by_device():
    cpu = load_recipe(base={"model": "m"})
    assert cpu.sampling_head.enabled and cpu.sampling_head.max_top_k == 32
    assert cpu.cuda_graphs.enabled is False and cpu.cuda_graphs.batch_sizes == [1, 2, 4, 8, 16, 32, 64]
    cuda = load_recipe(base={"model": "m"}, overrides=["target.device=cuda", "target.dtype=float16"])
    assert cuda.cuda_graphs.enabled is True
    off = load_recipe(base={"model": "m"}, overrides=["target.device=cuda", "cuda_graphs.enabled=false",
                                                      "cuda_graphs.batch_sizes=[1, 3]"])
    assert off.cuda_graphs.enabled is False and off.cuda_graphs.batch_sizes == [1, 3]


@pytest.mark.parametrize("override, message", [
    ("sampling_head.max_top_k=0", "sampling_head.max_top_k: must be >= 1"),
    ("cuda_graphs.batch_sizes=[]", "cuda_graphs.batch_sizes: give at least one"),
    ("cuda_graphs.batch_sizes=[0, 2]", "cuda_graphs.batch_sizes: must be >= 1"),
    ("cuda_graphs.batch_sizes=[a]", "expected list"),
    ("sampling_head.top_p=1", "unknown key 'top_p'"),
])
def test_recipe_sections_reject_bad_values(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(base={"model": "m"}, overrides=[override])


# -- AppendSamplingHead ------------------------------------------------------------------------
def test_append_sampling_head_before_after():
    before = head_graph()
    after = AppendSamplingHead(max_top_k=4).run(before)
    assert [n.op for n in before.nodes] == ["Embedding", "GatherTokens", "Linear"]
    assert [o.name for o in before.outputs] == ["logits"] and before.meta.sampling_head is None
    assert [n.op for n in after.nodes] == ["Embedding", "GatherTokens", "Linear", "ArgMax", "TopK"]
    argmax, topk = after.nodes[-2:]
    assert argmax.inputs == ["logits"] and topk.inputs == ["logits", "top_k"] and topk.attrs == {}
    assert [(i.name, i.text()) for i in after.inputs][-1] == ("top_k", "int64[1]")  # k per call, read on the host
    assert [(o.name, o.text()) for o in after.outputs] == [
        ("logits", "float32[num_logits, 11]"), ("next_token", "int64[num_logits]"),
        ("topk_values", "float32[num_logits, top_k]"), ("topk_indices", "int64[num_logits, top_k]")]
    assert after.meta.sampling_head == SamplingHead(max_top_k=4)


def test_append_sampling_head_clips_k_to_vocab():
    after = AppendSamplingHead(max_top_k=64).run(head_graph(vocab=5))
    assert after.meta.sampling_head == SamplingHead(max_top_k=5)


def test_append_sampling_head_needs_logits_output():
    g = head_graph()
    g.outputs = []
    g.add_output(g.nodes[1].outputs[0])
    with pytest.raises(SamplingHeadError, match="needs a float32 \\[num_logits, vocab\\] output 'logits'"):
        AppendSamplingHead(8).run(g)
    with pytest.raises(SamplingHeadError, match="already has a sampling head"):
        AppendSamplingHead(8).run(AppendSamplingHead(8).run(head_graph()))


def test_sampling_head_survives_cleanup():
    manager = PassManager([Phase("head", [AppendSamplingHead(3)]), Phase("cleanup", pipeline(
        load_recipe(base={"model": "m"}))[-1].passes)])
    out = manager.run(head_graph())
    assert [n.op for n in out.nodes][-2:] == ["ArgMax", "TopK"]


# -- PlanCudaGraphs ----------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, limit, slots, expected", [
    ([1, 2, 4, 8, 16, 32, 64], 8, None, [1, 2, 4, 8]),
    ([1, 2, 4, 8, 16, 32, 64], 12, None, [1, 2, 4, 8, 12]),
    ([4, 1, 2], 64, None, [1, 2, 4, 64]),
    ([1, 2, 4, 8], 8, 3, [1, 2, 3]),  # the KV plan fitted only 3 slots into its memory budget
])
def test_plan_cuda_graphs_before_after(sizes, limit, slots, expected):
    before = head_graph()
    if slots is not None:
        before.meta.kv_cache = KVCacheSpec(1, 2, 4, "float32", slots, 16)
    after = PlanCudaGraphs(sizes, limit).run(before)
    assert before.meta.cuda_graphs == CudaGraphs()  # none planned: the manifest's default
    assert after.meta.cuda_graphs == CudaGraphs(enabled=True, batch_sizes=tuple(expected))
    assert [n.op for n in after.nodes] == [n.op for n in before.nodes]


def test_pipeline_lists_both_passes_and_disables_them_visibly():
    def listed(*overrides):
        phases = pipeline(load_recipe(base={"model": "m"}, overrides=list(overrides)))
        return {p.name: (phase.name, isinstance(p, Disabled)) for phase in phases for p in phase.passes}

    cpu = listed()
    assert cpu["append_sampling_head"] == ("fusion", False) and cpu["plan_cuda_graphs"] == ("layout", True)
    cuda = listed("target.device=cuda", "target.dtype=float16", "sampling_head.enabled=false")
    assert cuda["append_sampling_head"] == ("fusion", True) and cuda["plan_cuda_graphs"] == ("layout", False)


def test_pass_error_names_the_sampling_head():
    g = head_graph()
    g.outputs = []
    with pytest.raises(PassError, match="append_sampling_head"):
        PassManager([Phase("fusion", [AppendSamplingHead(2)])]).run(g)


# -- the built engine --------------------------------------------------------------------------
def test_manifest_records_sampling_head_and_cuda_graphs(tiny_engine):
    manifest = json.loads((tiny_engine / "manifest.json").read_text())
    k = min(SamplingHeadOptions().max_top_k, manifest["model"]["hyperparameters"]["vocab_size"])
    assert manifest["sampling_head"] == {"max_top_k": k}
    assert manifest["cuda_graphs"] == {"enabled": False, "batch_sizes": []}
    outputs = manifest["io"]["outputs"]
    assert outputs["next_token"] == {"dtype": "int64", "shape": ["num_logits"]}
    assert outputs["topk_indices"] == {"dtype": "int64", "shape": ["num_logits", "top_k"]}
    assert manifest["io"]["inputs"]["top_k"] == {"dtype": "int64", "shape": [1]}
    assert outputs["topk_values"]["dtype"] == outputs["logits"]["dtype"] == "float32"


def engine_outputs(engine_dir, names: list[str], lens: list[int], top_k: int | None = None) -> list[np.ndarray]:
    """One ragged prefill through a plain session (TopK k `top_k`, default max_top_k); every real position."""
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    top_k = top_k or manifest["sampling_head"]["max_top_k"]
    spec = KVCacheSpec.from_dict(manifest["kv_cache"])
    vocab = manifest["model"]["hyperparameters"]["vocab_size"]
    rows, seq = len(lens), max(lens)
    ids = np.random.default_rng(3).integers(0, vocab, (rows, seq)).astype(np.int64)
    cos, sin = rope_tables(manifest["rope"], spec.max_seq_len, spec.dtype)
    feeds = {"input_ids": ids, "seqlens_k": np.array(lens, np.int32) - 1, "top_k": np.array([top_k], np.int64),
             "total_sequence_length": np.array(seq, np.int32), "cos_cache": cos, "sin_cache": sin,
             "logits_index": np.concatenate([r * seq + np.arange(n) for r, n in enumerate(lens)]).astype(np.int64)}
    kv = np.zeros((rows, spec.kv_heads, spec.max_seq_len, spec.head_dim), spec.dtype)
    feeds |= {f"past_{kind}_{layer}": kv for layer in range(spec.num_layers) for kind in ("key", "value")}
    session = ort.InferenceSession(str(engine_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(names, feeds)


def test_engine_sampling_head_matches_numpy_over_its_own_logits(tiny_engine):
    logits, token, values, indices = engine_outputs(
        tiny_engine, ["logits", "next_token", "topk_values", "topk_indices"], [7, 3, 5])
    k = values.shape[1]
    assert logits.shape[0] == 15 and token.dtype == indices.dtype == np.int64
    np.testing.assert_array_equal(token, logits.argmax(-1))
    expected = -np.sort(-logits, axis=-1)[:, :k]
    np.testing.assert_array_equal(values, expected)
    np.testing.assert_array_equal(np.take_along_axis(logits, indices, -1), values)
    assert all(len(set(row)) == k for row in indices.tolist())


def test_engine_top_k_input_sets_the_candidates_per_call(tiny_engine):
    """k = 1 (what a greedy call passes, so it does not pay for k candidates) gives the ArgMax."""
    token, values, indices = engine_outputs(tiny_engine, ["next_token", "topk_values", "topk_indices"], [7, 3], 1)
    assert values.shape == indices.shape == (10, 1)
    np.testing.assert_array_equal(indices[:, 0], token)
