"""llama.cpp as the peer on the same GGUF file (tools/bench/llama_cpp_peer.py, gguf_perplexity.py --peer).

llama-cpp-python is the `peer` extra (a native build), not a test dependency: without it both tools refuse with
the install line (checked everywhere); where it is installed, a tiny random float32 Llama GGUF written here
must give transformers' logits (loaded from the same file) and greedy tokens, at batch 1 and batch 2."""
from __future__ import annotations

import sys
from pathlib import Path

import click
import numpy as np
import pytest

from tests.builder.gguf_files import write_llama
from tools.bench import gguf_perplexity, llama_cpp_peer

TOKENIZER = Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target" / "tokenizer.json"
F32 = {k: "F32" for k in ("q", "k", "v", "o", "gate", "up", "down", "embed")}
PROMPTS = np.array([[5, 17, 42, 99, 7, 300, 12, 64], [9, 8, 7, 6, 5, 4, 3, 200]])
NEW_TOKENS = 10


def test_without_llama_cpp_both_tools_say_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[peer\]'"):
        llama_cpp_peer.LlamaCppBackend(tmp_path / "model.gguf", 1, 16, 1)
    with pytest.raises(click.UsageError, match=r"--peer needs llama-cpp-python"):
        gguf_perplexity.llama_cpp_model(tmp_path / "model.gguf", 16, 1)


def test_perplexity_windows_cut_the_given_text_else_the_topics_prose():
    """--text scores another text (code, say) in the same whole windows; without it, the topics' prose."""
    from tokenizers import Tokenizer

    encode = Tokenizer.from_file(str(TOKENIZER)).encode
    text = "def f(x):\n    return x + 1\n" * 40
    ids = encode(text, add_special_tokens=False).ids
    got = gguf_perplexity.windows(TOKENIZER, 64, 16, text)
    assert got.shape == (4, 16) and got.ravel().tolist() == ids[:64]
    assert gguf_perplexity.windows(TOKENIZER, 10_000, 16, text).size == len(ids) // 16 * 16  # the text runs out
    prose = encode(gguf_perplexity.topics_text(), add_special_tokens=False).ids
    assert gguf_perplexity.windows(TOKENIZER, 32, 16).ravel().tolist() == prose[:32]
    with pytest.raises(click.UsageError, match="no whole window"):
        gguf_perplexity.windows(TOKENIZER, 8, 16, text)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    return write_llama(tmp_path_factory.mktemp("peer") / "tiny.gguf", F32, hidden=64, inter=128, vocab=320)


def test_llama_cpp_logits_equal_transformers_on_the_same_file(tiny):
    ids = np.concatenate(PROMPTS)
    theirs = gguf_perplexity.transformers_model(tiny)(ids)
    peer = gguf_perplexity.llama_cpp_model(tiny, len(ids), 1)
    for _ in range(2):  # a second window reuses the context from a clean KV cache
        ours = peer(ids)
        assert ours.shape == theirs.shape
        assert np.abs(ours - theirs).max() < 2e-3 * max(1.0, np.abs(theirs).max())  # f16 KV cache
        assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_batched_sequences_give_each_rows_greedy_tokens(tiny):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny.parent), gguf_file=tiny.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(input_ids=torch.from_numpy(PROMPTS), attention_mask=torch.ones(PROMPTS.shape, dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    expected = out[:, PROMPTS.shape[1]:].tolist()
    backend = llama_cpp_peer.LlamaCppBackend(tiny, 2, 32, 1)
    try:
        batched = backend.generate(PROMPTS, NEW_TOKENS)
        single = [backend.generate(PROMPTS[i:i + 1], NEW_TOKENS).token_ids[0] for i in range(2)]
    finally:
        backend.close()
    assert batched.token_ids == single == expected
    assert 0 < batched.first_token_s < batched.total_s
