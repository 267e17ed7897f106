"""Tensor parallelism for every dense family we claim: a tiny random checkpoint of each (tests/builder/
test_families.py makes them with transformers' own config classes), built with 2 ranks and run on CPU
(the rank-1 worker all-reduces with rank 0 over torch.distributed gloo). Every position's logits of a
ragged batch match transformers' within LOGIT_TOL and greedy generation is token-identical. The configs
are the families' own variants where their heads divide by 2, small so the two ranks share 2 cores."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config

from runtime.engine import LLM
from runtime.request.params import SamplingParams
from test_families import (COMMON, COMMON_PHI3, PHI3_LONGROPE, VARIANTS, VOCAB, assert_logits_match, build,
                           make_family_checkpoint, ragged_prompts)

pytestmark = pytest.mark.e2e
NEW_TOKENS = 12

TP_VARIANTS = {
    "llama": lambda: LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=96, **COMMON),
    # partial rotary: the rotary tables are half of head_dim / 2 wide (the segments' cos/sin inputs too)
    "phi3": lambda: Phi3Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=96, rope_parameters=PHI3_LONGROPE, **COMMON_PHI3),
    "mistral": VARIANTS["mistral-window"],
    "qwen2": VARIANTS["qwen2-window-upper-layers"],  # 6 heads over 2 KV heads: one KV head per rank
    "qwen3": VARIANTS["qwen3-tied-window"],  # q/k norms: one fused q/k/v Linear and a Split, with q/k/v biases
    "gemma": VARIANTS["gemma-head-dim-256"],  # 1 KV head, replicated on both ranks
    "gemma2": VARIANTS["gemma2-softcap-window"],
    "gpt2": VARIANTS["gpt2-inner-80-unscaled"],  # a plain MLP, Conv1D weights, learned positions
    "gemma3": VARIANTS["gemma3-local-global"],  # local layers rotate by their own table before attention
}


@pytest.mark.parametrize("family", sorted(TP_VARIANTS))
def test_two_ranks_match_transformers(family, tmp_path):
    checkpoint = make_family_checkpoint(tmp_path / "ckpt", TP_VARIANTS[family]())
    engine = build(tmp_path, checkpoint, "parallel.tensor_parallel=2")
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    prompts = ragged_prompts(VOCAB)
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    llm = LLM(engine)
    try:
        assert llm.manifest.tensor_parallel.size == 2
        assert_logits_match(llm, model)
        results = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        assert [r.token_ids for r in results] == expected
    finally:
        llm.close()
