"""The llama.cpp peer of the int4 benchmark (tools/bench/gguf_peer.py) runs the same model as transformers.

llama-cpp-python is a bench-only source build, not a test dependency: the checks that run llama.cpp are
skipped where it is not installed (CI). Where it is, a tiny random tied-embedding Llama goes through
llama.cpp's own converter to a GGUF f32 and must give transformers' greedy tokens and logits."""
from __future__ import annotations

import numpy as np
import pytest

from tools.bench import gguf_peer
from tools.bench.decode import Workload
from tools.bench.quantized_head import side_by_side, target_line
from tools.checkpoints.make_checkpoint import make_checkpoint

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64]
NEW_TOKENS = 12


def test_without_llama_cpp_the_rows_say_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_peer, "llama_cpp_version", lambda: None)
    setup = gguf_peer.peer(tmp_path, tmp_path, Workload("tiny", (1,), 4, 4, 1, 1))
    assert setup.backends == [] and setup.builds == {}
    report = {"results": [], "backends": [], "builds": {}, "notes": setup.notes}
    rows = side_by_side(report)[1]
    assert [r[:2] for r in rows] == [[v.label, gguf_peer.INSTALL_HINT] for v in gguf_peer.VARIANTS]
    assert "not measured" in target_line(report)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random tied-embedding Llama and its GGUF f32 made by llama.cpp's converter."""
    pytest.importorskip("llama_cpp")
    version = gguf_peer.llama_cpp_version()
    try:
        src = gguf_peer.find_source(version)
    except FileNotFoundError as err:
        pytest.skip(str(err))
    root = tmp_path_factory.mktemp("gguf")
    checkpoint = make_checkpoint(root / "tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
                                 initializer_range=0.3)  # large enough that greedy tokens vary step by step
    return checkpoint, gguf_peer.convert(checkpoint, root / "tiny-f32.gguf", src)


def _transformers_greedy(checkpoint) -> tuple[list[int], np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=3)
    return out.sequences[0, len(PROMPT):].tolist(), torch.cat(out.logits).numpy()  # [new_tokens, vocab]


def test_gguf_f32_gives_transformers_greedy_tokens_and_logits(tiny):
    import llama_cpp

    checkpoint, f32 = tiny
    want_tokens, want_logits = _transformers_greedy(checkpoint)
    # float32 KV cache (llama.cpp's default is float16) so the comparison is float32 against float32
    llm = gguf_peer.load(f32, 64, 1, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    logits: list[np.ndarray] = []
    tokens = gguf_peer.greedy(llm, PROMPT, NEW_TOKENS, logits=logits)
    llm.close()
    assert tokens == want_tokens
    assert len(set(tokens)) > NEW_TOKENS // 2  # a varied sequence, not one token repeated
    np.testing.assert_allclose(np.stack(logits), want_logits, atol=2e-4, rtol=0)  # measured 2.5e-5, logits ~9


def test_q4_0_ggufs_quantize_the_blocks_and_stay_close(tiny, tmp_path):
    pytest.importorskip("gguf")
    checkpoint, f32 = tiny
    paths, builds = gguf_peer.prepare(checkpoint, tmp_path, threads=1)  # the benchmark's own path
    assert set(builds) == set(paths) == {v.name for v in gguf_peer.VARIANTS}
    # the default mix keeps the tied embedding (= output) at q6_K, or q8_0 where 64 columns cannot be q6_K
    embedding = {"q4_0": {"Q6_K", "Q8_0"}, "q4_0-pure": {"Q4_0"}}
    for name, path in paths.items():
        types = gguf_peer.tensor_types(path)
        blocks = {t for n, t in types.items() if n.startswith("blk.") and not n.endswith("norm.weight")}
        assert blocks == {"Q4_0"} and types["token_embd.weight"] in embedding[name] and "output.weight" not in types
    assert not (tmp_path / f"{checkpoint.name}-converted-f32.gguf").exists()
    assert gguf_peer.prepare(checkpoint, tmp_path, threads=1) == (paths, builds)  # cached: reused, not remade
    f32_logits, q4_logits = [], []
    for path, sink in ((f32, f32_logits), (paths["q4_0-pure"], q4_logits)):
        llm = gguf_peer.load(path, 64, 1)
        gguf_peer.greedy(llm, PROMPT, 1, logits=sink)
        llm.close()
    cosine = float(np.dot(f32_logits[0], q4_logits[0]) / np.linalg.norm(f32_logits[0]) / np.linalg.norm(q4_logits[0]))
    assert cosine > 0.6, f"q4_0 logits drifted from f32 (cosine {cosine:.3f}; measured 0.79 at 4 bits)"
