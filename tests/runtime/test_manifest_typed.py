"""The typed manifest (runtime/manifest/types.py): what the builder writes is what the runtime reads, a
missing field or a wrong type is refused by name, and the draft-vocabulary check is one function that
both the builder and LLM(draft=...) apply."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from builder.build import BuildError, build_engine
from builder.recipe import load_recipe
from runtime.engine import LLM
from runtime.manifest.load import EngineError, Manifest, draft_mismatch, read_manifest
from runtime.manifest.types import (Collective, CudaGraphs, Rope, SamplingHead, SegmentFile, Speculative, TensorParallel,
                                     TensorParallelRank)
from runtime.model.model_runner import ModelRunner
from runtime.model.rotary import rope_tables
from runtime.model.runner import Runner
from runtime.parallel.runner import TensorParallelRunner
from tools.checkpoints.make_checkpoint import make_checkpoint


def _json(engine: Path) -> dict:
    return json.loads((engine / "manifest.json").read_text())


def test_builder_written_manifest_round_trips(tiny_engine):
    manifest = read_manifest(tiny_engine)
    assert manifest.to_dict() == _json(tiny_engine)  # the file is exactly the dataclass's JSON form
    assert Manifest.from_dict(json.loads(manifest.to_json())) == manifest
    assert (tiny_engine / "manifest.json").read_text() == manifest.to_json()
    assert manifest.vocab_size == 512 and manifest.model.tokens.eos_token_ids == tuple(
        _json(tiny_engine)["model"]["tokens"]["eos_token_ids"])
    assert manifest.kv_cache.buffer_shape == (4, 2, 96, 16) and manifest.limits.max_seq_len == 96
    assert manifest.target.device == "cpu" and manifest.verification["passed"]
    assert manifest.speculative is None and manifest.tensor_parallel is None
    assert manifest["model"] == _json(tiny_engine)["model"]  # the JSON view for scripts


def test_tensor_parallel_build_writes_the_typed_manifest(tiny_checkpoint, tmp_path):
    recipe = load_recipe(base={"model": str(tiny_checkpoint)},
                         overrides=["limits.max_seq_len=48", "parallel.tensor_parallel=2", "verify.enabled=off"])
    engine = build_engine(recipe, tmp_path / "tp2", log=lambda _: None)
    manifest = read_manifest(engine)
    assert manifest.to_dict() == _json(engine)
    section = manifest.tensor_parallel
    assert section.size == 2 and [r.rank for r in section.ranks] == [0, 1]
    assert all(s.file in manifest.files for r in section.ranks for s in r.segments)
    assert len(section.collectives) == len(section.ranks[0].segments) - 1
    assert manifest.verification == {"skipped": "tensor_parallel > 1: the build-time check is not run on "
                                                "sharded engines"}


def test_every_optional_section_round_trips(tiny_engine):
    manifest = read_manifest(tiny_engine).replace(
        speculative=Speculative(draft_dir="draft", draft_model="ckpt", draft_quantization="int4_rtn",
                                num_draft_tokens=4),
        tensor_parallel=TensorParallel(size=2, ranks=(TensorParallelRank(rank=0, segments=(
            SegmentFile(file="rank0.seg00.onnx", layers=(0,), inputs={}, outputs={}),)),),
            collectives=(Collective(after_segment=0, input="a", output="b"),), replicated=("embedding",)),
        sampling_head=SamplingHead(max_top_k=8), cuda_graphs=CudaGraphs(enabled=True, batch_sizes=(1, 2)))
    again = Manifest.from_dict(json.loads(manifest.to_json()))
    assert again == manifest and again.tensor_parallel.ranks[0].segments[0].file == "rank0.seg00.onnx"
    assert again["speculative"]["num_draft_tokens"] == 4 and again.cuda_graphs.batch_sizes == (1, 2)


def test_optional_sections_absent_from_an_older_manifest_take_their_defaults(tiny_engine):
    data = _json(tiny_engine)
    for key in ("quantization", "cuda_graphs", "sampling_head", "passes", "recipe", "verification"):
        data.pop(key, None)
    manifest = Manifest.from_dict(data)
    assert manifest.quantization.mode == "none" and not manifest.cuda_graphs.enabled
    assert manifest.sampling_head is None and manifest.verification is None


def _drop(path: str):
    def edit(data: dict) -> None:
        *parents, leaf = path.split(".")
        for part in parents:
            data = data[part]
        del data[leaf]
    return edit


def _put(path: str, value):
    def edit(data: dict) -> None:
        *parents, leaf = path.split(".")
        for part in parents:
            data = data[part]
        data[leaf] = value
    return edit


BAD_FIELDS = {  # id: edit -> words the EngineError must contain
    "missing-tokens": (_drop("model.tokens"), ["model.tokens is missing"]),
    "missing-eos": (_drop("model.tokens.eos_token_ids"), ["model.tokens.eos_token_ids is missing"]),
    "missing-limit": (_drop("limits.max_seq_len_cap"), ["limits.max_seq_len_cap is missing"]),
    "missing-kv-field": (_drop("kv_cache.head_dim"), ["kv_cache.head_dim is missing"]),
    "limit-is-text": (_put("limits.max_seq_len", "96"), ["limits.max_seq_len is str", "expected int"]),
    "limit-is-bool": (_put("limits.max_batch_size", True), ["limits.max_batch_size is bool"]),
    "vocab-is-text": (_put("model.hyperparameters.vocab_size", "512"), ["model.hyperparameters.vocab_size"]),
    "no-vocab": (_drop("model.hyperparameters.vocab_size"), ["model.hyperparameters.vocab_size is None"]),
    "eos-is-text": (_put("model.tokens.eos_token_ids", ["</s>"]), ["model.tokens.eos_token_ids[0] is str"]),
    "inv-freq-not-list": (_put("rope.inv_freq", 0.5), ["rope.inv_freq is float", "expected a list"]),
    "target-not-object": (_put("target", "cpu"), ["target is str", "expected an object"]),
    "kv-dtype": (_put("kv_cache.dtype", "int3"), ["kv_cache is invalid", "int3"]),
    "file-entry": (lambda m: m["files"]["model.onnx"].pop("bytes"), ["files.model.onnx.bytes is missing"]),
}


@pytest.mark.parametrize("case", BAD_FIELDS)
def test_missing_or_mistyped_field_is_named(case, tiny_engine):
    edit, words = BAD_FIELDS[case]
    data = _json(tiny_engine)
    edit(data)
    with pytest.raises(EngineError) as err:
        Manifest.from_dict(data)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_llm_refuses_a_mistyped_manifest_by_field(tiny_engine, tmp_path):
    engine = shutil.copytree(tiny_engine, tmp_path / "engine")
    data = _json(engine)
    data["limits"]["max_seq_len"] = "ninety-six"
    (engine / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EngineError, match="limits.max_seq_len is str 'ninety-six', expected int"):
        LLM(engine)


def test_a_newer_major_builders_manifest_is_refused_by_version_not_by_field(tiny_engine, tmp_path):
    engine = shutil.copytree(tiny_engine, tmp_path / "engine")
    data = _json(engine)
    data["builder_version"], data["limits"] = "99.0.0", {"max_tokens": 96}
    (engine / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EngineError, match="built by builder 99.0.0, newer in major version"):
        read_manifest(engine)


def test_rope_tables_read_the_typed_section_and_its_json_alike(tiny_engine):
    manifest = read_manifest(tiny_engine)
    assert isinstance(manifest.rope, Rope)
    typed, raw = rope_tables(manifest.rope, 32, "float32"), rope_tables(manifest["rope"], 32, "float32")
    np.testing.assert_array_equal(typed[0], raw[0])
    np.testing.assert_array_equal(typed[1], raw[1])


def test_runners_share_a_base_not_each_other():
    assert issubclass(ModelRunner, Runner) and issubclass(TensorParallelRunner, Runner)
    assert not issubclass(TensorParallelRunner, ModelRunner)


# -- the draft-vocabulary check: one function, used by the builder and by LLM(draft=...) ----------
@pytest.fixture(scope="module")
def other_vocab_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("vocab384") / "ckpt", hidden_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=384, seed=5)


@pytest.fixture(scope="module")
def other_vocab_engine(other_vocab_checkpoint, tmp_path_factory) -> Path:
    recipe = load_recipe(base={"model": str(other_vocab_checkpoint)},
                         overrides=["limits.max_seq_len=96", "verify.enabled=off"])
    return build_engine(recipe, tmp_path_factory.mktemp("vocab384-engine") / "e", log=lambda _: None)


def test_draft_mismatch_compares_vocabularies(tiny_engine, other_vocab_engine):
    target, other = read_manifest(tiny_engine), read_manifest(other_vocab_engine)
    assert draft_mismatch(target, target) is None
    problem = draft_mismatch(target, other)
    assert problem == ("the draft's vocabulary (384) differs from the target's (512); a draft must share the "
                       "target's tokenizer")


def test_llm_refuses_a_draft_with_another_vocabulary(tiny_engine, other_vocab_engine):
    with pytest.raises(EngineError, match=r"draft engine .*: the draft's vocabulary \(384\) differs from the "
                                          r"target's \(512\)"):
        LLM(tiny_engine, draft=other_vocab_engine)


def test_build_refuses_a_draft_with_another_vocabulary(tiny_checkpoint, other_vocab_checkpoint, tmp_path):
    recipe = load_recipe(base={"model": str(tiny_checkpoint)},
                         overrides=["limits.max_seq_len=96", "verify.enabled=off",
                                    f"speculative.draft_model={other_vocab_checkpoint}"])
    with pytest.raises(BuildError, match=r"speculative: the draft's vocabulary \(384\) differs from the "
                                         r"target's \(512\)"):
        build_engine(recipe, tmp_path / "engine", log=lambda _: None)
    assert not (tmp_path / "engine").exists()  # nothing half-built is left
