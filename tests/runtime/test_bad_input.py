"""Bad input, table-driven: every case is one line. Each asserts the exit code (or the exception), that
the message names the problem, and that nothing on disk was deleted or half-written."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from builder.cli import main as build_cli
from runtime.cli import main as run_cli
from runtime.engine import LLM, RequestError
from runtime.request.params import SamplingParams


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under `root` with the sha256 of its bytes: equal before and after = nothing lost."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


# -- checkpoint damage helpers: each takes the checkpoint copy and breaks one thing ----------------------
def _edit_config(ckpt: Path, **changes) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | changes))


def _edit_tensor(ckpt: Path, name: str, fn) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    tensors[name] = fn(tensors[name])
    save_file(tensors, ckpt / "model.safetensors")


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _shard_index(ckpt: Path) -> None:
    names = load_file(ckpt / "model.safetensors")
    half = sorted(names)[: len(names) // 2]
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" if n in half else "model-00002-of-00002.safetensors"
                  for n in names}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _user_files(folder: Path) -> str:
    folder.mkdir()
    (folder / "thesis.txt").write_text("years of work")
    return str(folder)


def _a_file(file: Path) -> str:
    file.write_text("notes")
    return str(file)


Q = "model.layers.0.self_attn.q_proj.weight"
# id: (break the checkpoint copy `c` / make the output, given tmp root `t`) -> --out, exit code, words in the message
BUILD_CASES = {
    "out-user-dir": (lambda c, t: _user_files(t / "mine"), 2, ["mine", "not empty", "not an engine"]),
    "out-file": (lambda c, t: _a_file(t / "notes.txt"), 2, ["notes.txt", "is a file"]),
    "out-cwd": (lambda c, t: ".", 2, ["current directory"]),
    "out-cwd-absolute": (lambda c, t: str(t / "cwd"), 2, ["current directory"]),
    "out-parent-of-cwd": (lambda c, t: "..", 2, ["parent"]),
    "out-symlink-to-file": (lambda c, t: (t / "link").symlink_to(_a_file(t / "notes.txt")) or str(t / "link"), 2,
                            ["link"]),
    "out-checkpoint": (lambda c, t: str(c), 2, ["checkpoint", "ckpts/ckpt"]),
    "out-contains-checkpoint": (lambda c, t: str(c.parent), 2, ["checkpoint"]),
    "out-inside-checkpoint": (lambda c, t: str(c / "engine"), 2, ["checkpoint"]),
    "config-invalid-json": (lambda c, t: (c / "config.json").write_text("{oops") and None, 2, ["config.json", "JSON"]),
    "config-auto-map": (lambda c, t: _edit_config(c, auto_map={"AutoModelForCausalLM": "x.Evil"}), 2,
                        ["auto_map", "never runs checkpoint code"]),
    "zero-heads": (lambda c, t: _edit_config(c, num_attention_heads=0), 2, ["num_attention_heads", "positive integer"]),
    "string-size": (lambda c, t: _edit_config(c, hidden_size="abc"), 2, ["hidden_size", "'abc'"]),
    "heads-do-not-divide": (lambda c, t: _edit_config(c, hidden_size=65), 2, ["config.json", "multiple"]),
    "config-not-object": (lambda c, t: (c / "config.json").write_text("[1]") and None, 2, ["JSON object"]),
    "unknown-model-type": (lambda c, t: _edit_config(c, model_type="nosuchmodel"), 2, ["model_type", "nosuchmodel"]),
    "truncated-safetensors": (lambda c, t: _truncate(c / "model.safetensors"), 2, ["model.safetensors", "truncated"]),
    "garbage-safetensors": (lambda c, t: (c / "model.safetensors").write_bytes(b"\xff" * 64) and None, 2,
                            ["model.safetensors", "corrupt"]),
    "missing-shard": (lambda c, t: _shard_index(c), 2, ["model-00002-of-00002.safetensors", "missing"]),
    "wrong-shape": (lambda c, t: _edit_tensor(c, Q, lambda a: a[:-1]), 2, [Q, "[63, 64]", "expected [64, 64]"]),
    "wrong-dtype": (lambda c, t: _edit_tensor(c, Q, lambda a: a.astype(np.int32)), 2, [Q, "I32"]),
    "broken-tokenizer": (lambda c, t: (c / "tokenizer.json").write_text("{") and None, 2, ["tokenizer.json", "load"]),
    "tokenizer-bigger-than-vocab": (lambda c, t: _edit_config(c, vocab_size=100), 2, ["512 tokens", "vocab_size is 100"]),
    "generation-config-invalid": (lambda c, t: (c / "generation_config.json").write_text("{") and None, 2,
                                  ["generation_config.json", "JSON"]),
    "out-under-a-file": (lambda c, t: _a_file(t / "notes.txt") + "/engine", 2, ["notes.txt", "cannot create"]),
    "no-tokenizer": (lambda c, t: (c / "tokenizer.json").unlink(), 2, ["tokenizer.json"]),
}


@pytest.mark.parametrize("case", BUILD_CASES)
def test_build_refuses(case, tiny_checkpoint, tmp_path, monkeypatch):
    make, code, words = BUILD_CASES[case]
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "ckpts" / "ckpt")
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "keep.txt").write_text("the user's work")
    out = make(ckpt, tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(ckpt), "verify": {"enabled": "off"}}))
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path / "cwd")
    result = CliRunner().invoke(build_cli, ["--recipe", str(recipe), "--out", out])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.output, (word, result.output)
    assert snapshot(tmp_path) == before  # nothing deleted, nothing half-written


def test_engine_with_a_user_file_inside_is_not_replaced(tiny_checkpoint, tiny_engine, tmp_path):
    out = shutil.copytree(tiny_engine, tmp_path / "engine")
    (out / "notes.txt").write_text("mine")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny_checkpoint)}))
    before = snapshot(tmp_path)
    result = CliRunner().invoke(build_cli, ["--recipe", str(recipe), "--out", str(out)])
    assert result.exit_code == 2 and "files the engine does not list" in result.output, result.output
    assert snapshot(tmp_path) == before


def test_recipe_out_key_is_checked_like_the_option(tiny_checkpoint, tmp_path):
    mine = _user_files(tmp_path / "mine")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny_checkpoint), "out": mine}))
    before = snapshot(tmp_path)
    result = CliRunner().invoke(build_cli, ["--recipe", str(recipe)])
    assert result.exit_code == 2 and "not empty" in result.output and mine in result.output
    assert snapshot(tmp_path) == before


RECIPE_CASES = {  # id: recipe file bytes -> words in the message
    "non-utf8-recipe": (b"model: \xff\xfe\n", ["recipe.yaml", "UTF-8"]),
    "missing-random-checkpoint": (b"model: checkpoints/random/nope\n",
                                  ["checkpoints/random/nope", "python -m tools.checkpoints.make_checkpoint"]),
    "missing-checkpoint": (b"model: /no/such/dir\n", ["/no/such/dir", "no such checkpoint directory"]),
    "missing-relative-checkpoint": (b"model: no/such/dir\n", ["'no/such/dir'", str(Path.cwd() / "no/such/dir"),
                                                              "resolved against the working directory"]),
}


@pytest.mark.parametrize("case", RECIPE_CASES)
def test_build_refuses_recipe(case, tmp_path):
    data, words = RECIPE_CASES[case]
    (tmp_path / "recipe.yaml").write_bytes(data)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(build_cli, ["--recipe", str(tmp_path / "recipe.yaml"), "--out",
                                            str(tmp_path / "engine")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    for word in words:
        assert word in result.output, (word, result.output)
    assert snapshot(tmp_path) == before


# -- engine-run --------------------------------------------------------------------------------------
def _fail_every_call(monkeypatch):
    from runtime.model.model_runner import ModelRunner

    def boom(self, *args, **kwargs):
        raise RuntimeError("the kernel exploded")

    monkeypatch.setattr(ModelRunner, "run", boom)


RUN_CASES = {  # id: (extra args, stdin bytes, setup(monkeypatch)) -> exit code, words
    "non-utf8-stdin": ([], b"def f(\xff\xfe):", None, 2, ["stdin", "not UTF-8"]),
    "huge-stdin": ([], b"x" * 2_000_000, None, 2, ["at most", "bytes"]),
    "generation-error": (["--prompt", "def f("], None, _fail_every_call, 1, ["generation failed", "kernel exploded"]),
    "max-seq-len-too-big": (["--prompt", "hi", "--max-seq-len", "100000"], None, None, 2, ["--max-seq-len 100000"]),
}


@pytest.mark.parametrize("case", RUN_CASES)
def test_run_fails_honestly(case, tiny_engine, monkeypatch):
    args, stdin, setup, code, words = RUN_CASES[case]
    if setup:
        setup(monkeypatch)
    before = snapshot(tiny_engine)
    result = CliRunner().invoke(run_cli, ["--engine", str(tiny_engine), "--max-new-tokens", "4"] + args, input=stdin)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.output, (word, result.output)
    assert snapshot(tiny_engine) == before


# -- the Python API ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_engine):
    engine = LLM(tiny_engine, max_batch_size=2)
    yield engine
    engine.close()


API_CASES = {  # id: call(llm) -> words in the RequestError
    "params-dict": (lambda m: m.submit("hi", {"max_new_tokens": 4}), ["SamplingParams", "dict"]),
    "params-dict-generate": (lambda m: m.generate(["hi"], {"temperature": 0}), ["SamplingParams", "dict"]),
    "prompt-none": (lambda m: m.submit(None), ["str or a sequence", "NoneType"]),
    "prompt-bytes": (lambda m: m.submit(b"hi"), ["str or a sequence", "bytes"]),
    "float-token-ids": (lambda m: m.submit([1, 2.7, 3]), ["2.7", "not an integer"]),
    "numpy-float-ids": (lambda m: m.generate([np.array([1.0, 2.0])]), ["not an integer"]),
    "bool-token-id": (lambda m: m.submit([True, 5]), ["not an integer"]),
    "generate-bare-str": (lambda m: m.generate("def f():"), ["list of prompts", "str"]),
    "lone-surrogate": (lambda m: m.submit("abc\udcff"), ["not valid Unicode"]),
    "huge-prompt": (lambda m: m.submit("x" * 20_000_000), ["at most", "UTF-8 bytes"]),
    "empty-prompt": (lambda m: m.submit([]), ["empty"]),
}


@pytest.mark.parametrize("case", API_CASES)
def test_api_rejects(case, llm):
    call, words = API_CASES[case]
    with pytest.raises(RequestError) as err:
        call(llm)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert llm.executor.stats()["running"] == 0  # refused before any work


def test_api_accepts_numpy_integer_ids(llm):
    ids = np.array([5, 6, 7], dtype=np.int64)
    assert llm.generate([ids], SamplingParams(max_new_tokens=2))[0].finish_reason in ("length", "stop")


# -- manifest.json edited after the build: refused at load, by what the graph says -------------------
def _set(path: str, value):
    def edit(manifest: dict) -> None:
        *parents, leaf = path.split(".")
        node = manifest
        for part in parents:
            node = node[part]
        node[leaf] = value
    return edit


MANIFEST_CASES = {  # id: edit(manifest) -> words in the EngineError
    "kv-heads": (_set("kv_cache.kv_heads", 4), ["kv_cache.kv_heads is 4", "past_key_0 has 2"]),
    "head-dim": (_set("kv_cache.head_dim", 32), ["kv_cache.head_dim is 32"]),
    "num-layers": (_set("kv_cache.num_layers", 3), ["kv_cache.num_layers is 3", "2 past_key"]),
    "vocab": (_set("model.hyperparameters.vocab_size", 1000), ["vocab_size is 1000", "logits have 512"]),
    "rope-table": (lambda m: m["rope"]["inv_freq"].append(0.5), ["rope.inv_freq has 9", "cos_cache is 8"]),
    "eos-outside-vocab": (_set("model.tokens.eos_token_ids", [7, 99999]), ["[99999]", "outside the vocabulary"]),
    "max-seq-len-over-cap": (_set("limits.max_seq_len_cap", 100000), ["max_seq_len_cap 100000", "position limit"]),
    "kv-max-seq-len": (_set("kv_cache.max_seq_len", 1000), ["kv_cache.max_seq_len 1000"]),
    "io-names": (lambda m: m["io"]["inputs"].pop("seqlens_k"), ["seqlens_k"]),
    "builder-major": (_set("builder_version", "99.0.0"), ["99.0.0", "upgrade"]),
    "builder-garbage": (_set("builder_version", "latest"), ["'latest'", "not a version"]),
    "format-version": (_set("format_version", 2), ["format version 2"]),
}


def _edited_engine(tiny_engine: Path, tmp_path: Path, edit) -> Path:
    engine = shutil.copytree(tiny_engine, tmp_path / "engine")
    manifest = json.loads((engine / "manifest.json").read_text())
    edit(manifest)
    (engine / "manifest.json").write_text(json.dumps(manifest))
    return engine


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_edited_manifest_is_refused(case, tiny_engine, tmp_path):
    from runtime.manifest.load import EngineError

    edit, words = MANIFEST_CASES[case]
    engine = _edited_engine(tiny_engine, tmp_path, edit)
    with pytest.raises(EngineError) as err:
        LLM(engine)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    result = CliRunner().invoke(run_cli, ["--engine", str(engine), "--prompt", "hi"])
    assert result.exit_code == 2 and "Traceback" not in result.output and words[0] in result.output


VERSION_WARNINGS = {  # id: edit -> words in the RuntimeWarning; the engine still loads
    "newer-builder-minor": (_set("builder_version", "0.99.0"), ["0.99.0", "newer"]),
    "older-onnxruntime": (_set("target.built_with.onnxruntime", "99.1.0"), ["99.1.0", "older"]),
}


@pytest.mark.parametrize("case", VERSION_WARNINGS)
def test_version_rule_warns(case, tiny_engine, tmp_path):
    edit, words = VERSION_WARNINGS[case]
    with pytest.warns(RuntimeWarning) as record:
        LLM(_edited_engine(tiny_engine, tmp_path, edit)).close()
    text = " ".join(str(w.message) for w in record)
    assert all(word in text for word in words), text
