"""Mixture-of-experts families against transformers, as tests/builder/test_families.py does for the dense
ones: a tiny random checkpoint per family made with transformers' own config class (saved in the hub's
form: one tensor per expert, Mixtral's block_sparse_moe names), each with something unusual. Logits within
LOGIT_TOL of transformers' eager attention in float32, a chunk on a cached past, greedy tokens identical over
NEW_TOKENS for a ragged batch of 4 through `LLM`; quantized experts exact against transformers on the
dequantized experts, and their greedy agreement with the float model recorded."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_families import (COMMON, NEW_TOKENS, VOCAB, _prefix_agreement, assert_logits_match, build,
                           make_family_checkpoint, ragged_prompts, reference_greedy)
# the dense families' three checks (logits, a chunk on a cached past, a greedy ragged batch), collected here so
# pytest runs them on this module's `built` fixture: every MoE variant
from test_families import (test_chunked_extension_matches_full_forward, test_greedy_batch_matches_generate,  # noqa: F401
                           test_logits_match_transformers)
from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from builder.quant.schemes import fake_quantize
from runtime.engine import LLM
from runtime.request.params import SamplingParams

pytestmark = pytest.mark.e2e

VARIANTS = {
    # 8 experts, top-2 renormalised, on every layer; a sliding window shorter than the prompts
    "mixtral-8-experts-top2": lambda: MixtralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, intermediate_size=32, num_local_experts=8,
                                                    num_experts_per_tok=2, sliding_window=7, **COMMON),
    # norm_topk_prob, top-3 of 6, layer 1 dense (mlp_only_layers) between two sparse layers
    "qwen3moe-normtopk-dense-layer": lambda: Qwen3MoeConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                                            num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                                            moe_intermediate_size=32, num_experts=6,
                                                            num_experts_per_tok=3, norm_topk_prob=True,
                                                            mlp_only_layers=[1], **COMMON),
    # a shared expert with its sigmoid gate, top-2 of 5 not renormalised, decoder_sparse_step 2 (layer 1 sparse),
    # q/k/v biases, a window of 5 on layers >= 1
    "qwen2moe-shared-expert": lambda: Qwen2MoeConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                                     num_key_value_heads=2, intermediate_size=96,
                                                     moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                     num_experts=5, num_experts_per_tok=2, decoder_sparse_step=2,
                                                     use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                                     **COMMON),
    # attention sinks (made large below), windows of 5 alternating with full layers, a SwiGLU limit that clamps
    "gptoss-sinks-window": lambda: GptOssConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                                num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                                                swiglu_limit=0.5, **COMMON),
}


def make_moe_checkpoint(out, config):
    """As make_family_checkpoint; gpt-oss's sinks are set large (N(0, 0.1) would barely change the softmax)."""
    checkpoint = make_family_checkpoint(out, config)
    if config.model_type == "gpt_oss":
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, config.num_attention_heads))
        model.save_pretrained(str(checkpoint))
    return checkpoint


def eager(checkpoint):
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def built(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = make_moe_checkpoint(root / "ckpt", VARIANTS[request.param]())
    model = eager(checkpoint)
    return LLM(build(root, checkpoint)), model, checkpoint, root, [reference_greedy(model, p)
                                                                     for p in ragged_prompts(VOCAB)]


@pytest.mark.parametrize("mode,bits,block", [("int8", 8, 0), ("int4_rtn", 4, 32)])
def test_quantized_experts_exact_on_dequantized_weights(built, mode, bits, block, record_property):
    """Only the experts quantized (every Linear excluded), accuracy_level 0 (float activations): the
    engine equals transformers with the experts replaced by their dequantized values. The greedy
    agreement of the quantized engine with the float model is recorded."""
    _, model, checkpoint, root, references = built
    engine = build(root / mode, checkpoint, f"quantization.mode={mode}", "quantization.group_size=32",
                   "quantization.accuracy_level=0", 'quantization.exclude=["*"]')
    llm = LLM(engine)
    reference = eager(checkpoint)
    with torch.no_grad():
        for layer in reference.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            for weight in (experts.gate_up_proj, experts.down_proj) if experts is not None else ():
                weight.copy_(torch.from_numpy(_dequantized(weight.numpy(), bits, block, model.config.model_type)))
    assert_logits_match(llm, reference)
    results = llm.generate(ragged_prompts(VOCAB), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    agree = [_prefix_agreement(r.token_ids, ref) for r, ref in zip(results, references)]
    record_property(f"{mode}_experts_greedy_prefix_agreement", agree)
    print(f"{model.config.model_type}: {mode} experts, greedy prefix agreement with float {agree} of {NEW_TOKENS}")


def _dequantized(w: np.ndarray, bits: int, block: int, model_type: str) -> np.ndarray:
    """Each expert's [out, in] matrix quantized along `in` (gpt-oss stores [in, out])."""
    transposed = model_type == "gpt_oss"
    experts = np.swapaxes(w, 1, 2) if transposed else w
    out = np.stack([fake_quantize(e, bits, block or e.shape[1]) for e in experts])
    return np.ascontiguousarray(np.swapaxes(out, 1, 2) if transposed else out)


def test_engine_run_serve_and_ngram_speculation_on_qwen3_moe(tmp_path):
    """engine-run, engine-serve and prompt-lookup speculation serve an MoE engine unchanged: the drafted
    tokens equal plain greedy, which equals transformers."""
    from click.testing import CliRunner

    from runtime.cli import main as run_cli
    from runtime.speculation.speculator import Speculation

    checkpoint = make_moe_checkpoint(tmp_path / "ckpt", VARIANTS["qwen3moe-normtopk-dense-layer"]())
    engine = build(tmp_path, checkpoint)
    llm = LLM(engine)
    text = "def main(args):\n    return args"
    prompt = llm.encode(text) * 3
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain, = llm.generate([prompt], params)
    drafted, = llm.generate([prompt], params, speculation=Speculation("ngram"))
    assert plain.token_ids == drafted.token_ids == reference_greedy(eager(checkpoint), prompt)
    result = CliRunner().invoke(run_cli, ["--engine", str(engine), "--prompt", text, "--max-new-tokens", "12",
                                          "--ignore-eos"])
    assert result.exit_code == 0, result.output
    expected, = llm.generate([text], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert result.stdout.rstrip("\n") == expected.text  # the prompt echo is on stderr
    _serve_matches_generate(llm, text)
    llm.close()


def _serve_matches_generate(llm, text: str) -> None:
    """engine-serve's OpenAI completions endpoint returns what LLM.generate does."""
    import openai

    from runtime.serve.app import RunningServer, create_app

    running = RunningServer(create_app({"moe": llm}))
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        served = client.completions.create(model="moe", prompt=text, max_tokens=12, temperature=0)
    finally:
        running.stop()
    expected, = llm.generate([text], SamplingParams(max_new_tokens=12))
    assert served.choices[0].text == expected.text


@pytest.mark.parametrize("variant", ["mixtral-8-experts-top2", "qwen2moe-shared-expert"])
def test_tensor_parallel_splits_the_experts(tmp_path, variant):
    """tensor_parallel 2: each rank keeps half of every expert's intermediate channels (and of the shared
    expert's), the router whole; logits within tolerance and greedy tokens as transformers'."""
    checkpoint = make_moe_checkpoint(tmp_path / "ckpt", VARIANTS[variant]())
    model = eager(checkpoint)
    llm = LLM(build(tmp_path, checkpoint, "parallel.tensor_parallel=2"))
    try:
        assert llm.manifest.tensor_parallel.size == 2
        assert_logits_match(llm, model)
        results = llm.generate(ragged_prompts(VOCAB), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        llm.close()
    assert [r.token_ids for r in results] == [reference_greedy(model, p) for p in ragged_prompts(VOCAB)]


def test_tensor_parallel_refuses_experts_it_cannot_split(tmp_path):
    from builder.build import BuildError
    from builder.pass_manager import PassError

    config = MixtralConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=30, num_local_experts=4, num_experts_per_tok=2, **COMMON)
    checkpoint = make_moe_checkpoint(tmp_path / "ckpt", config)  # 4 heads split 4 ways, the experts' 30 channels not
    with pytest.raises((PassError, BuildError), match="moe_intermediate_size 30 is not divisible by tensor_parallel 4"):
        build(tmp_path, checkpoint, "parallel.tensor_parallel=4")
    assert not (tmp_path / "engine").exists()


def test_moe_families_listed_and_unknown_moe_choice_named():
    from builder.spec import SpecError, load_spec, spec_for

    for architecture in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"):
        assert spec_for(architecture).moe
    spec = load_spec("mixtral")
    with pytest.raises(SpecError, match="moe.activation is 'gelu'; allowed: \\['silu', 'clamped_swiglu'\\]"):
        type(spec)(**{**spec.__dict__, "moe": {**spec.moe, "activation": "gelu"}})


def test_gpt_oss_mxfp4_experts_dequantized_at_build(tmp_path):
    """A gpt-oss checkpoint in the hub's MXFP4 form (experts as <param>_blocks / _scales, a mxfp4
    quantization_config): the engine equals transformers with the experts dequantized by transformers' own
    convert_moe_packed_tensors."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    checkpoint = make_moe_checkpoint(tmp_path / "ckpt", VARIANTS["gptoss-sinks-window"]())
    model = eager(checkpoint)
    tensors, rng = load_file(str(checkpoint / "model.safetensors")), np.random.default_rng(0)
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, k, n = tensors.pop(name).shape  # [E, in, out]
        blocks = torch.from_numpy(rng.integers(0, 256, (experts, n, k // 32, 16), dtype=np.uint8))
        scales = torch.from_numpy(rng.integers(118, 125, (experts, n, k // 32), dtype=np.uint8))  # 2^-9 .. 2^-3
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        with torch.no_grad():
            model.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert_logits_match(LLM(build(tmp_path, checkpoint)), model)
