import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tools.checkpoints.make_checkpoint import PRESETS, count_parameters, main, make_checkpoint

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
TEXT = "Grüße, 世界! naïve café — emoji 🚀🦙 and code: def f(x): return x ** 2\n\ttabs"


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _load(path: Path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma3"])
def test_loads_and_generates(tmp_path, family):
    path = make_checkpoint(tmp_path / family, family=family, seed=3)
    model = _load(path)
    assert type(model).__name__.lower().startswith(family)
    ids = torch.tensor([[1, 10, 20, 30]])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 3)
    cfg = _config(path)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 3)


def test_loaded_logits_match_in_memory_model(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", seed=7)
    config = LlamaConfig.from_pretrained(path)
    torch.manual_seed(7)
    fresh = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[1, 5, 9, 200, 511]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, _load(path)(ids).logits)


def test_same_seed_is_deterministic(tmp_path):
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=1)
    c = make_checkpoint(tmp_path / "c", seed=2)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (c / "tokenizer.json").read_text()


def test_sharded_checkpoint(tmp_path):
    path = make_checkpoint(tmp_path / "sharded", shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert shards == {p.name for p in path.glob("*.safetensors")}
    assert not (path / "model.safetensors").exists()
    model = _load(path)
    assert count_parameters(path) == sum(p.numel() for p in model.parameters())


def test_tokenizer_round_trip(tmp_path):
    path = make_checkpoint(tmp_path / "tok", vocab_size=700)
    fast = Tokenizer.from_file(str(path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(path)
    assert fast.get_vocab_size() == len(auto) == 700
    ids = fast.encode(TEXT).ids
    assert ids[0] == 1
    assert fast.decode(ids) == TEXT
    assert auto(TEXT)["input_ids"] == ids
    assert auto.decode(ids, skip_special_tokens=True) == TEXT
    assert [auto.unk_token_id, auto.bos_token_id, auto.eos_token_id, auto.pad_token_id] == [0, 1, 2, 3]
    chat = auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi</s>\n<|assistant|>\n"


def test_llama3_rope_scaling_applied(tmp_path):
    plain = _load(make_checkpoint(tmp_path / "plain"))
    scaled_path = make_checkpoint(tmp_path / "scaled", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)
    rope = _config(scaled_path)["rope_parameters"]
    assert rope == {**LLAMA3_SCALING, "rope_theta": 500000.0}
    scaled = _load(scaled_path)
    assert scaled.model.rotary_emb.rope_type == "llama3"
    default_theta = _load(make_checkpoint(tmp_path / "theta", rope_theta=500000.0))
    assert not torch.allclose(scaled.model.rotary_emb.inv_freq, default_theta.model.rotary_emb.inv_freq)
    assert not torch.allclose(plain.model.rotary_emb.inv_freq, default_theta.model.rotary_emb.inv_freq)


def test_qwen2_has_qkv_bias(tmp_path):
    path = make_checkpoint(tmp_path / "qwen2", family="qwen2")
    attn = _load(path).model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    assert attn.o_proj.bias is None
    assert _config(path)["sliding_window"] is None


def test_llama_attention_bias_and_mistral_rejects_it(tmp_path):
    attn = _load(make_checkpoint(tmp_path / "llama", attention_bias=True)).model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is not None
    with pytest.raises(ValueError):
        make_checkpoint(tmp_path / "mistral", family="mistral", attention_bias=True)


@pytest.mark.parametrize("tie", [True, False])
def test_tie_word_embeddings(tmp_path, tie):
    path = make_checkpoint(tmp_path / "tie", tie_word_embeddings=tie)
    assert _config(path)["tie_word_embeddings"] is tie
    model = _load(path)
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tie


def test_head_dim_override(tmp_path):
    path = make_checkpoint(tmp_path / "hd", head_dim=32)
    assert _config(path)["head_dim"] == 32
    assert _load(path).model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dtype_recorded(tmp_path, dtype):
    path = make_checkpoint(tmp_path / dtype, dtype=dtype)
    assert _config(path)["dtype"] == dtype
    assert _load(path).dtype == getattr(torch, dtype)


def test_cli_tiny_preset_with_override(tmp_path):
    out = tmp_path / "cli"
    result = CliRunner().invoke(main, [str(out), "--preset", "tiny", "--layers", "3", "--family", "mistral"])
    assert result.exit_code == 0, result.output
    cfg = _config(out)
    assert cfg["num_hidden_layers"] == 3
    assert cfg["hidden_size"] == PRESETS["tiny"]["hidden_size"]
    assert cfg["model_type"] == "mistral"
    assert f"{count_parameters(out):,} parameters" in result.output
