"""The llama.cpp peer of the mixture-of-experts benchmark (tools/bench/moe_peer.py): llama.cpp f32 / q8_0 / q4_0
beside our float32 / int8 / int4 engines at batch 1.

llama-cpp-python is a bench-only source build: the check that runs llama.cpp is skipped where it is not installed
(CI). Where it is, a tiny random Qwen3-MoE goes through llama.cpp's own converter and must give transformers'
greedy tokens, and its q8_0 / q4_0 files must quantize the expert blocks."""
from __future__ import annotations

import numpy as np
import pytest

from tools.bench import gguf_peer, moe_peer
from tools.bench.decode import Workload
from tools.checkpoints.make_checkpoint import make_checkpoint

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64]
NEW_TOKENS = 10


def test_without_llama_cpp_the_rows_say_how_to_install_it_and_targets_are_not_measured(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_peer, "llama_cpp_version", lambda: None)
    setup = gguf_peer.peer(tmp_path, tmp_path, Workload("moe1b", (1,), 4, 4, 1, 1), variants=moe_peer.VARIANTS)
    assert setup.backends == [] and len(setup.notes) == 3
    result = {"backend": "engine int4", "decode_tok_s": {"median": 80.0, "min": 70.0, "max": 90.0}, "ttft_s_median": 0.1}
    report = {"results": [result], "backends": ["engine int4"], "builds": {}, "notes": setup.notes,
              "parameters": {"active_per_token": 178_000_000}}
    header, rows = moe_peer.side_by_side(report)
    assert rows[0][:2] == ["engine int4", "80.0"] and rows[0][6] == str(round(178 * (0.5 + 4 / 32)))
    assert [r[:2] for r in rows[1:]] == [[v.label, gguf_peer.INSTALL_HINT] for v in moe_peer.VARIANTS]
    assert all("not measured" in line for line in moe_peer.target_lines(report))


def test_target_lines_compare_medians():
    med = {"engine int8": 60.0, "llama.cpp q8_0": 50.0, "engine fp32": 10.0, "transformers": 5.0}
    report = {"results": [{"backend": b, "decode_tok_s": {"median": m}} for b, m in med.items()]}
    lines = moe_peer.target_lines(report)
    assert "engine int8 / llama.cpp q8_0: 1.20x (target >= 1.0x: meets)" in lines
    assert "engine fp32 / transformers: 2.00x (target >= 3.0x: MISSES)" in lines


def test_llama_cpp_runs_a_qwen3_moe_like_transformers(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import llama_cpp
    import torch
    from transformers import AutoModelForCausalLM

    try:
        gguf_peer.find_source(gguf_peer.llama_cpp_version())
    except FileNotFoundError as err:
        pytest.skip(str(err))
    checkpoint = make_checkpoint(tmp_path / "moe", family="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=512,
                                 initializer_range=0.3,
                                 moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          norm_topk_prob=True))
    paths, _ = gguf_peer.prepare(checkpoint, tmp_path / "gguf", moe_peer.VARIANTS, threads=1)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=3)[0, len(PROMPT):]
    llm = gguf_peer.load(paths["f32"], 64, 1, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    assert gguf_peer.greedy(llm, PROMPT, NEW_TOKENS) == want.tolist()
    llm.close()
    for name, kind in (("q8_0", "Q8_0"), ("q4_0", "Q4_0")):
        types = gguf_peer.tensor_types(paths[name])
        experts = {t for n, t in types.items() if "_exps" in n}
        assert experts and experts <= {kind, "Q6_K", "Q8_0", "Q4_1", "Q5_0", "Q5_1"}, (name, experts)
    assert np.all([p.is_file() for p in paths.values()])
