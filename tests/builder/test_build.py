"""engine-build behaviour: manifest contents, verification record, atomic output, clear refusals."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from builder import build as build_module
from builder.build import build_engine
from builder.cli import main as build_cli
from builder.recipe import load_recipe
from builder.weights import Checkpoint
from builder.spec import SpecError
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import load_manifest


def test_manifest_records_build(tiny_engine):
    manifest = load_manifest(tiny_engine)
    assert manifest["model"]["architecture"] == "LlamaForCausalLM"
    assert len(manifest["model"]["config_sha256"]) == 64
    assert manifest["recipe"]["limits"]["max_seq_len"] == 96
    spec = KVCacheSpec.from_dict(manifest["kv_cache"])
    assert spec.buffer_shape == (4, 2, 96, 16) and manifest["kv_cache"]["bytes"] == spec.bytes
    assert {"model.onnx", "model.onnx.data", "tokenizer.json"} <= set(manifest["files"])
    assert [p["name"] for p in manifest["passes"]] == [
        "fold_rotary", "permute_activations", "fuse_qkv", "fuse_gate_up", "fuse_add_rmsnorm", "append_sampling_head",
        "append_hidden_output", "add_lora", "shard_tensor_parallel", "search_awq_scales", "solve_gptq", "quantize_weights", "add_block_minimums", "plan_kv_cache", "calibrate_kv_scales", "plan_cuda_graphs",
        "remove_dead_nodes"]
    report = manifest["verification"]
    assert report["passed"] and report["greedy_agreement"] == 1.0 and report["max_abs_error"] < 1e-4


def test_verification_failure_writes_no_engine(tiny_checkpoint, tmp_path):
    recipe = load_recipe(base={"model": str(tiny_checkpoint)},
                         overrides=["limits.max_seq_len=64", "verify.enabled=on", "verify.tolerance=0"])
    with pytest.raises(build_module.BuildError, match="verification failed"):
        build_engine(recipe, tmp_path / "engine", log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_build_leaves_nothing_and_keeps_old_engine(tiny_checkpoint, tmp_path, monkeypatch):
    recipe = load_recipe(base={"model": str(tiny_checkpoint)},
                         overrides=["limits.max_seq_len=64", "verify.enabled=off"])
    out = build_engine(recipe, tmp_path / "engine", log=lambda _: None)
    before = (out / "manifest.json").read_text()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "copy_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_engine(recipe, out, log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
    assert (out / "manifest.json").read_text() == before


def test_disabled_fusions_still_build_exact_engine(tiny_checkpoint, tmp_path):
    recipe = load_recipe(base={"model": str(tiny_checkpoint)}, overrides=[
        "limits.max_seq_len=64", "passes.fuse_qkv=false", "passes.fuse_gate_up=false",
        "passes.fuse_add_rmsnorm=false", "verify.enabled=on"])
    manifest = load_manifest(build_engine(recipe, tmp_path / "engine", log=lambda _: None))
    assert manifest["verification"]["passed"]
    assert [p["disabled"] for p in manifest["passes"]][:5] == [False, False, True, True, True]


def test_dump_ir_writes_before_and_after_each_phase(tiny_checkpoint, tmp_path):
    recipe = load_recipe(base={"model": str(tiny_checkpoint)}, overrides=["verify.enabled=off",
                                                                         "limits.max_seq_len=64"])
    build_engine(recipe, tmp_path / "engine", dump_ir=tmp_path / "ir", log=lambda _: None)
    names = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert names[:2] == ["00-after-fusion.ir", "00-before-fusion.ir"] and len(names) == 12  # 6 phases
    assert "Rotary(" in (tmp_path / "ir" / "00-before-fusion.ir").read_text()
    assert "concat(" in (tmp_path / "ir" / "00-after-fusion.ir").read_text()


def test_uncovered_parameters_name_architecture(tiny_checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["mlp_bias"] = True  # the skeleton now has parameters the checkpoint lacks
    (ckpt / "config.json").write_text(json.dumps(config))
    recipe = load_recipe(base={"model": str(ckpt)}, overrides=["verify.enabled=off"])
    with pytest.raises(Exception, match="mlp.down_proj.bias"):
        build_engine(recipe, tmp_path / "engine", log=lambda _: None)
    config["architectures"] = ["GPTBigCodeForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match="GPTBigCodeForCausalLM.*supported"):
        build_engine(recipe, tmp_path / "engine", log=lambda _: None)


def test_cli_reports_bad_recipe_key(tmp_path, tiny_checkpoint):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_checkpoint}\nlimits: {{max_seq: 5}}\n")
    result = CliRunner().invoke(build_cli, ["--recipe", str(recipe)])
    assert result.exit_code == 2
    assert "max_seq" in result.output and "max_seq_len" in result.output


def test_cli_builds_with_set_override(tmp_path, tiny_checkpoint):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_checkpoint}\n")
    out = tmp_path / "engine"
    result = CliRunner().invoke(build_cli, ["--recipe", str(recipe), "--set", "limits.max_seq_len=48",
                                            "--out", str(out), "--no-verify"])
    assert result.exit_code == 0, result.output
    assert load_manifest(out)["limits"]["max_seq_len"] == 48


def test_llama7b_int8_tp2_recipe_builds(tiny_checkpoint, tmp_path):
    """int8 and tensor parallelism are both supported: the recipe builds two ranks (on a tiny model)."""
    recipe = load_recipe("build_recipes/llama7b_int8_tp2.yaml", [f"model={tiny_checkpoint}",
                                                                 "limits.max_seq_len=64"])
    manifest = load_manifest(build_engine(recipe, tmp_path / "engine", log=lambda _: None))
    assert manifest["tensor_parallel"]["size"] == 2 and manifest["quantization"]["mode"] == "int8"


def test_float16_cpu_engine_verified(tiny_checkpoint, tmp_path):
    recipe = load_recipe(base={"model": str(tiny_checkpoint)},
                         overrides=["limits.max_seq_len=64", "target.dtype=float16", "verify.enabled=on"])
    manifest = load_manifest(build_engine(recipe, tmp_path / "engine", log=lambda _: None))
    assert manifest["target"]["dtype"] == "float16" and manifest["kv_cache"]["dtype"] == "float16"
    assert manifest["verification"]["passed"] and manifest["verification"]["max_abs_error"] < 0.05


def test_cuda_engine_explains_missing_provider(tiny_checkpoint, tmp_path):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine can run cuda engines")
    from runtime.engine import LLM
    from runtime.manifest.load import EngineError

    recipe = load_recipe(base={"model": str(tiny_checkpoint)},
                         overrides=["limits.max_seq_len=64", "target.device=cuda", "target.dtype=bfloat16"])
    engine = build_engine(recipe, tmp_path / "engine", log=lambda _: None)
    manifest = load_manifest(engine)
    assert manifest["target"]["device"] == "cuda" and manifest["verification"]["checked"].startswith("a float32 twin")
    with pytest.raises(EngineError, match="CUDAExecutionProvider.*rebuild"):
        LLM(engine)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_checkpoint_reads_own_their_memory(tiny_checkpoint):
    """A read tensor is a copy and the safetensors file is not left mapped: otherwise every page a build
    reads would stay resident in the builder until the build ends (the whole model, for float32)."""
    from safetensors import safe_open

    ckpt = Checkpoint(tiny_checkpoint)
    name = "model.embed_tokens.weight"
    array = ckpt.read(name)
    assert array.flags.owndata and array.dtype == np.float32
    assert str(tiny_checkpoint / "model.safetensors") not in Path("/proc/self/maps").read_text()
    with safe_open(str(tiny_checkpoint / "model.safetensors"), framework="pt") as f:
        np.testing.assert_array_equal(array, f.get_tensor(name).float().numpy())
