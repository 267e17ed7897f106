"""Model families as data, end to end against transformers: a tiny random checkpoint per family variant,
made here with transformers' own config class (each with something unusual: odd head counts, GQA
ratios, tied/untied embeddings, a sliding window shorter than the prompts), built into an engine.
Logits must match transformers' eager attention within LOGIT_TOL (float32 engine vs float32 reference)
and greedy generation through `LLM` must be token-identical over NEW_TOKENS tokens for a ragged batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GemmaConfig, GPT2Config,
                          MistralConfig, Phi3Config, Qwen2Config, Qwen3Config)

from builder.build import build_engine
from builder.recipe import load_recipe
from builder.spec import SpecError, evaluate
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from tools.checkpoints.make_checkpoint import BOS_ID, EOS_ID, PAD_ID, _write_generation_config, make_tokenizer

pytestmark = pytest.mark.e2e
LOGIT_TOL = 1e-4  # float32 engine vs float32 transformers (eager attention), random weights, logits ~ O(1)
NEW_TOKENS = 32
VOCAB = 384
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.1, bos_token_id=BOS_ID,
              eos_token_id=EOS_ID, pad_token_id=PAD_ID)
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                 "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5, 3.0, 4.0],
                 "long_factor": [2.0, 3.0, 5.0, 8.0, 9.0, 10.0, 12.0, 16.0], "original_max_position_embeddings": 128}
COMMON_PHI3 = COMMON | {"max_position_embeddings": 512, "original_max_position_embeddings": 128}

VARIANTS = {
    # 3 query heads over 1 KV head, head_dim 32 != hidden / heads, untied
    "qwen3-mqa-odd-heads": lambda: Qwen3Config(hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                                               num_key_value_heads=1, head_dim=32, intermediate_size=96,
                                               tie_word_embeddings=False, **COMMON),
    # tied embeddings, q/k/v biases, the window (5) shorter than every prompt but one, on every layer
    "qwen3-tied-window": lambda: Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                             tie_word_embeddings=True, attention_bias=True,
                                             use_sliding_window=True, sliding_window=5, max_window_layers=0,
                                             **COMMON),
    "mistral-window": lambda: MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=96, sliding_window=7,
                                            **COMMON),
    # the window only on layers >= max_window_layers (layer 1 of 2): mixed windowed and full layers
    "qwen2-window-upper-layers": lambda: Qwen2Config(hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                                                     num_key_value_heads=2, intermediate_size=96,
                                                     use_sliding_window=True, sliding_window=4,
                                                     max_window_layers=1, **COMMON),
    # head_dim 256 (much wider than hidden / heads), MQA, tied, GeGLU (tanh GELU), (1 + w) norms, sqrt(h) scale
    "gemma-head-dim-256": lambda: GemmaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                              num_key_value_heads=1, head_dim=256, intermediate_size=64,
                                              **COMMON),
    # soft-capping on scores and logits (small caps so they bite), alternating windows of 6, pre-attn scalar
    "gemma2-softcap-window": lambda: Gemma2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                                  query_pre_attn_scalar=24, sliding_window=6,
                                                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                                  **COMMON),
    # Gemma 3: q/k norms (1 + w), two sliding layers (window 4, shorter than 3 of the prompts) then a global one
    # (sliding_window_pattern 3), each kind with its own rotary table: local base 100, global base 50000 with
    # linear scaling x4; pre-attn scalar 24 != head_dim; final soft-capping, no attention soft-capping
    "gemma3-local-global": lambda: Gemma3TextConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                                    num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                                    query_pre_attn_scalar=24, sliding_window=4,
                                                    sliding_window_pattern=3, rope_local_base_freq=100.0,
                                                    rope_theta=50000.0,
                                                    rope_scaling={"rope_type": "linear", "factor": 4.0},
                                                    final_logit_softcapping=3.0, **COMMON),
    # longrope with short != long factors, partial rotary (half of head_dim 32), 5 query heads over 1 KV head
    "phi3-longrope-partial": lambda: Phi3Config(hidden_size=160, num_hidden_layers=2, num_attention_heads=5,
                                                num_key_value_heads=1, intermediate_size=96,
                                                rope_parameters=PHI3_LONGROPE, **COMMON_PHI3),
    # learned positions, n_inner not 4 * hidden, unscaled attention scores, Conv1D weights, tied embeddings
    "gpt2-inner-80-unscaled": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, n_inner=80, vocab_size=VOCAB,
                                                 scale_attn_weights=False,
                                                 n_positions=256, initializer_range=0.1, bos_token_id=BOS_ID,
                                                 eos_token_id=EOS_ID, pad_token_id=PAD_ID),
}


def make_family_checkpoint(out, config, seed: int = 3):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(out))
    _write_generation_config(out)
    make_tokenizer(out, config.vocab_size)
    return out


def build(root, checkpoint, *overrides):
    recipe = load_recipe(base={"model": str(checkpoint)},
                         overrides=["limits.max_seq_len=96", "limits.max_batch_size=4", "verify.enabled=off",
                                    *overrides])
    return build_engine(recipe, root / "engine", log=lambda _: None)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def built(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = make_family_checkpoint(root / "ckpt", VARIANTS[request.param]())
    engine = build(root, checkpoint)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return LLM(engine), model, checkpoint, root, [reference_greedy(model, p) for p in ragged_prompts(VOCAB)]


def ragged_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(4, vocab, n).tolist() for n in (11, 3, 17, 6)]


def reference_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=PAD_ID)
    return out[0, len(prompt):].tolist()


def batch_logits(llm, prompts: list[list[int]]) -> list[np.ndarray]:
    """Every token's logits of a ragged first-prompt batch, one [len, vocab] array per prompt."""
    seq = max(map(len, prompts))
    ids = np.array([p + [PAD_ID] * (seq - len(p)) for p in prompts], dtype=np.int64)
    lens = np.array([len(p) for p in prompts])
    index = np.concatenate([row * seq + np.arange(len(p)) for row, p in enumerate(prompts)])
    return np.split(llm.runner.run(0, ids, lens - 1, seq, index), np.cumsum(lens)[:-1])


def assert_logits_match(llm, model, atol=LOGIT_TOL):
    """Every position's logits of a ragged first-prompt batch equal transformers' on each prompt alone."""
    prompts = ragged_prompts(VOCAB)
    for p, got in zip(prompts, batch_logits(llm, prompts)):
        with torch.no_grad():
            np.testing.assert_allclose(got, model(torch.tensor([p])).logits[0].numpy(), atol=atol, rtol=0)


def assert_chunk_on_cached_past_matches(llm, model):
    """A chunk on top of a cached past (past longer than any window) gives the full-sequence logits."""
    tokens = ragged_prompts(VOCAB)[2]
    llm.runner.prefill(0, [tokens[:9]])
    chunk = llm.runner.extend(0, 9, tokens[9:], all_logits=True)
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0, 9:].numpy()
    np.testing.assert_allclose(chunk, ref, atol=LOGIT_TOL, rtol=0)


def assert_greedy_batch_matches(llm, references):
    """A ragged batch of 4 through LLM.generate gives transformers' greedy tokens for each prompt."""
    results = llm.generate(ragged_prompts(VOCAB), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [r.token_ids for r in results] == references


def test_logits_match_transformers(built):
    llm, model, _, _, _ = built
    assert_logits_match(llm, model)


def test_chunked_extension_matches_full_forward(built):
    llm, model, _, _, _ = built
    assert_chunk_on_cached_past_matches(llm, model)


def test_greedy_batch_matches_generate(built):
    llm, _, _, _, references = built
    assert_greedy_batch_matches(llm, references)


def test_int4_greedy_agreement_reported(built, record_property):
    """int4 (MatMulNBits) applies to every family's linear layers; its greedy agreement with the float
    reference is recorded (junit property and stdout) with a loose sanity bound: random tiny weights
    quantize badly, so only the first tokens are expected to agree often."""
    _, model, checkpoint, root, references = built
    engine = build(root / "int4", checkpoint, "quantization.mode=int4_rtn", "quantization.lm_head=none")
    llm = LLM(engine)
    prompts = ragged_prompts(VOCAB)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    agree = [_prefix_agreement(r.token_ids, ref) for r, ref in zip(results, references)]
    share = sum(agree) / (NEW_TOKENS * len(prompts))
    record_property("int4_greedy_prefix_agreement", share)
    print(f"{model.config.model_type}: int4 greedy prefix agreement {share:.2f} ({agree} of {NEW_TOKENS})")
    assert all(len(r.token_ids) == NEW_TOKENS for r in results)
    assert max(agree) >= 1, "int4 engine disagrees with transformers from the first token on every prompt"


def _prefix_agreement(ours: list[int], ref: list[int]) -> int:
    same = 0
    for a, b in zip(ours, ref):
        if a != b:
            break
        same += 1
    return same


def test_spec_defaults_cannot_run_code():
    assert evaluate("hidden_size / num_heads", {"hidden_size": 96, "num_heads": 6}) == 16
    for bad in ("__import__('os').system('true')", "hidden_size.__class__", "[1][0]", "lambda: 1"):
        with pytest.raises(SpecError, match="only names, numbers|not an arithmetic"):
            evaluate(bad, {"hidden_size": 96})


def test_engine_run_executor_and_ngram_speculation_unchanged_on_gemma2(tmp_path):
    """engine-run (with prompt-lookup speculation) and LLM's executor serve a new family unchanged:
    the speculative tokens equal plain greedy, which equals transformers."""
    from click.testing import CliRunner

    from runtime.cli import main as run_cli
    from runtime.speculation.speculator import Speculation

    checkpoint = make_family_checkpoint(tmp_path / "ckpt", VARIANTS["gemma2-softcap-window"]())
    engine = build(tmp_path, checkpoint)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    llm = LLM(engine)
    text = "def main(args):\n    return args"
    prompt = llm.encode(text) * 3  # repeats, so prompt lookup finds drafts
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain, = llm.generate([prompt], params)
    drafted, = llm.generate([prompt], params, speculation=Speculation("ngram"))
    assert plain.token_ids == drafted.token_ids == reference_greedy(model, prompt)
    result = CliRunner().invoke(run_cli, ["--engine", str(engine), "--prompt", text, "--speculate", "ngram",
                                          "--max-new-tokens", "12", "--ignore-eos"])
    assert result.exit_code == 0, result.output
    expected, = llm.generate([text], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert result.stdout.rstrip("\n") == expected.text  # the prompt echo is on stderr
    llm.close()


def test_sliding_window_recorded_in_kv_plan(tmp_path):
    """Every layer windowed: the plan records the window (the cache could be sized to it) and keeps the
    full-length buffer; one full-attention layer (Qwen2 max_window_layers): no window recorded."""
    import json

    for name, window in (("mistral-window", 7), ("qwen2-window-upper-layers", None)):
        checkpoint = make_family_checkpoint(tmp_path / name / "ckpt", VARIANTS[name]())
        plan = json.loads((build(tmp_path / name, checkpoint) / "manifest.json").read_text())["kv_cache"]
        assert plan["sliding_window"] == window and plan["max_seq_len"] == 96


def test_unsupported_config_fields_and_architectures_are_named(tmp_path):
    bidirectional = VARIANTS["gemma-head-dim-256"]()
    bidirectional.use_bidirectional_attention = True
    checkpoint = make_family_checkpoint(tmp_path / "bidir" / "ckpt", bidirectional)
    with pytest.raises(SpecError, match="use_bidirectional_attention=True"):
        build(tmp_path / "bidir", checkpoint)
    from transformers import PhiConfig

    phi = PhiConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                    vocab_size=VOCAB)
    checkpoint = make_family_checkpoint(tmp_path / "phi" / "ckpt", phi)
    with pytest.raises(SpecError, match="'PhiForCausalLM' is not covered by any model spec; supported: .*GPT2"):
        build(tmp_path / "phi", checkpoint)


def test_list_families_option():
    from click.testing import CliRunner

    from builder.cli import main as build_cli

    result = CliRunner().invoke(build_cli, ["--list-families"])
    assert result.exit_code == 0 and "soft-capping" in result.output
    for architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM"):
        assert architecture in result.output


def test_longrope_beyond_its_short_factors_is_refused(tmp_path):
    """Past original_max_position_embeddings transformers switches Phi-3 to the long factors; the engine's
    rotary tables are fixed, so such a max_seq_len is a build error naming the bound."""
    from builder.build import BuildError
    from builder.pass_manager import PassError

    checkpoint = make_family_checkpoint(tmp_path / "ckpt", VARIANTS["phi3-longrope-partial"]())
    with pytest.raises((PassError, BuildError), match="exceeds original_max_position_embeddings 128.*<= 128"):
        build(tmp_path, checkpoint, "limits.max_seq_len=200")
    with pytest.raises(ValueError, match="128"):  # nor can the runtime raise max_seq_len past it
        LLM(build(tmp_path, checkpoint), max_seq_len=200)
