"""tools/checkpoints/make_large_checkpoint.py writes a safetensors checkpoint by streaming: transformers loads it and
the engine builder builds it."""
from __future__ import annotations

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tools.checkpoints.make_large_checkpoint import LLAMA2_7B, make_large_checkpoint, tensor_shapes


def test_llama2_7b_shapes_count_its_parameters():
    assert sum(int(torch.tensor(s).prod()) for s in tensor_shapes(**LLAMA2_7B).values()) == 6_738_415_616


def test_streamed_checkpoint_loads_in_transformers(tmp_path):
    path = make_large_checkpoint(tmp_path / "ckpt", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=344, vocab_size=300, seed=1)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.dtype == torch.bfloat16 and model.config.num_key_value_heads == 2
    assert model.config.architectures == ["LlamaForCausalLM"]  # what engine-build matches a spec by
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight").float()
        assert f.get_tensor("model.norm.weight").eq(1).all()
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight.float(), q)
    assert 0.015 < q.std().item() < 0.025 and model(torch.tensor([[5, 6, 7]])).logits.isfinite().all()
