"""Gemma 3 (text) specifics beyond tests/builder/test_families.py's end-to-end checks: the per-layer-type
rotary tables (a sliding layer rotates by its own base before GroupQueryAttention, a global layer inside it),
an int8 KV cache, the tiny-checkpoint maker's gemma3 entry, and the refusals named (paged attention, the
multimodal Gemma3ForConditionalGeneration)."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from transformers import AutoModelForCausalLM

from builder.passes.fold_rotary import FoldRotary
from builder.spec import SpecError
from builder.trace import trace
from runtime.engine import LLM
from runtime.request.params import SamplingParams
from test_families import (VARIANTS, VOCAB, assert_logits_match, build, make_family_checkpoint, ragged_prompts,
                           reference_greedy)
from tools.checkpoints.make_checkpoint import make_checkpoint

pytestmark = pytest.mark.e2e
LOCAL, GLOBAL = "sliding_attention", "full_attention"
KV_INT8_LOGIT_TOLERANCE = 0.06  # of the largest reference logit, as tests/builder/test_int8_kv.py bounds it


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_family_checkpoint(tmp_path_factory.mktemp("gemma3") / "ckpt", VARIANTS["gemma3-local-global"]())


@pytest.fixture(scope="module")
def reference(checkpoint):
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def test_each_layer_type_rotates_by_its_own_table(checkpoint, tmp_path):
    """The runtime's table is the global layers' (rope_theta 50000, linear x4); the sliding layers' table
    (base 100) is graph.meta.layer_ropes' and their Attention names it after fold_rotary."""
    graph = trace(checkpoint)
    assert set(graph.meta.layer_ropes) == {LOCAL}
    assert graph.meta.rope.type == "linear" and graph.meta.layer_ropes[LOCAL].type == "default"
    half = 8  # head_dim 16
    assert graph.meta.rope.inv_freq[1] == pytest.approx(50000.0 ** (-2 / 16) / 4, rel=1e-6)
    assert graph.meta.layer_ropes[LOCAL].inv_freq[1] == pytest.approx(100.0 ** (-2 / 16), rel=1e-6)
    assert len(graph.meta.layer_ropes[LOCAL].inv_freq) == half
    folded = FoldRotary().run(graph)
    tables = {n.attrs["layer"]: n.attrs.get("table") for n in folded.nodes_of("Attention")}
    assert tables == {0: LOCAL, 1: LOCAL, 2: None} and not any(folded.nodes_of("Rotary"))

    model = onnx.load(str(build(tmp_path, checkpoint) / "model.onnx"), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["RotaryEmbedding"] == 4  # q and k of the two sliding layers
    rotary = [next(a.i for a in n.attribute if a.name == "do_rotary") for n in model.graph.node
              if n.op_type == "GroupQueryAttention"]
    assert rotary == [0, 0, 1]
    assert {i.name for i in model.graph.input} >= {"cos_cache", "sin_cache"}


@pytest.mark.parametrize("load", [{}, {"graph_decode": True}], ids=["plain", "graph-decode"])
def test_decode_far_past_the_window_matches_transformers(checkpoint, reference, tmp_path, load):
    """One prompt decoded 100 tokens (positions to 116, the window 4) on an engine built for 96 and loaded
    for 160 (the tables are not sized at build), plain and on fixed decode buffers (where
    total_sequence_length is the buffer length): every token is transformers'."""
    llm = LLM(build(tmp_path, checkpoint), max_seq_len=160, **load)
    prompt = ragged_prompts(VOCAB)[2]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=100, min_new_tokens=100,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    result, = llm.generate([prompt], SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert result.token_ids == expected
    llm.close()


def test_float16_engine(checkpoint, reference, tmp_path):
    """A float16 engine: the local table's cos/sin rows are computed in float32 and cast, as the runtime casts
    its own table; logits within float16's error (measured 0.005 of logits ~2.4), greedy identical."""
    llm = LLM(build(tmp_path, checkpoint, "target.dtype=float16"))
    assert_logits_match(llm, reference, atol=0.02)
    results = llm.generate(ragged_prompts(VOCAB), SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert [r.token_ids for r in results] == [reference_greedy(reference, p)[:16] for p in ragged_prompts(VOCAB)]
    llm.close()


def test_int8_kv_cache(checkpoint, reference, tmp_path):
    """kv_cache.dtype int8 (K rotated before it is stored, by either table): logits within the int8 KV
    bound, greedy tokens identical to transformers on the ragged batch."""
    llm = LLM(build(tmp_path, checkpoint, "kv_cache.dtype=int8"))
    largest = max(float(np.abs(reference(torch.tensor([p])).logits.detach().numpy()).max())
                  for p in ragged_prompts(VOCAB))
    assert_logits_match(llm, reference, atol=KV_INT8_LOGIT_TOLERANCE * largest)
    results = llm.generate(ragged_prompts(VOCAB), SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == [reference_greedy(reference, p) for p in ragged_prompts(VOCAB)]
    llm.close()


def test_make_checkpoint_gemma3_entry(tmp_path):
    """The maker's gemma3 (5 sliding : 1 global, a short stack ending on a global layer; local rope base
    10000): with rope_theta the same as the local base there is one table only, and the engine matches."""
    checkpoint = make_checkpoint(tmp_path / "ckpt", family="gemma3", num_layers=3, initializer_range=0.1, seed=2)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["layer_types"] == [LOCAL, LOCAL, GLOBAL]
    assert trace(checkpoint).meta.layer_ropes == {}
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    llm = LLM(build(tmp_path, checkpoint))
    assert_logits_match(llm, model)
    llm.close()


def test_paged_attention_refuses_a_layer_table(tmp_path):
    """Paged attention (CUDA) does not lower a layer's own rotary table: the build names it (a window no
    shorter than max_seq_len, so the window refusal does not come first)."""
    config = VARIANTS["gemma3-local-global"]()
    config.sliding_window = 128
    checkpoint = make_family_checkpoint(tmp_path / "ckpt", config)
    with pytest.raises(ValueError, match="paged attention with a layer's own rotary table .*'sliding_attention'"):
        build(tmp_path, checkpoint, "target.device=cuda", "target.dtype=float16", "target.attention=paged",
              "kv_cache.block_size=16")
    assert not (tmp_path / "engine").exists()


def test_multimodal_gemma3_is_refused_by_name(checkpoint, tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (model_type gemma3, the text model under text_config) is
    refused naming what it is and what the engine builds."""
    import shutil

    shutil.copytree(checkpoint, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    wrapped = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
               "text_config": {**config, "architectures": None}}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(wrapped))
    with pytest.raises(SpecError, match="'Gemma3ForConditionalGeneration' is not supported: it is the multimodal "
                                        "Gemma 3 .* builds the text-only Gemma3ForCausalLM"):
        build(tmp_path, tmp_path / "ckpt")


def test_layer_by_layer_float_run_is_the_whole_models(checkpoint):
    """LayerwiseModel (GPTQ's and AWQ's calibration runs) gives each layer its own keyword arguments: run in
    float layer by layer, the final norm's output is transformers' whole model's on the same ids. Layer 0's
    arguments for every layer gave the global layer the sliding layers' rotary table and window-4 mask."""
    from builder.quant.layerwise import LayerwiseModel

    ids = [[(7 * i + 3 * j) % VOCAB for i in range(48)] for j in range(3)]
    model = LayerwiseModel(checkpoint)
    hidden = model.layer_inputs(ids)
    names: list[str] = []
    for index in range(len(model.layers)):
        hidden = model.run_layer(index, hidden, lambda name, x: names.append(name))
    ours = np.concatenate(model.final_hidden(hidden))
    whole = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = whole.get_decoder()(torch.tensor(ids)).last_hidden_state.numpy()
    assert np.abs(ours - theirs).max() < 1e-4 * max(1.0, np.abs(theirs).max())
    assert names.count("model.layers.2.self_attn.q_proj") == 1  # no update: each layer runs once per batch


def test_int8_kv_extremes_come_from_the_models_own_forward(checkpoint):
    """int8 KV's calibration (capture_kv_extremes, layer by layer) sees what the model computes: each layer's V
    extremes equal those of v_proj's outputs in transformers' whole model. The whole model switched to the
    recording attention built the masks for it, not for sdpa, and ran Gemma 3's sliding layers unmasked
    (final hidden states off by 4.6)."""
    from builder.quant.layerwise import capture_kv_extremes

    ids = [[(7 * i + 3 * j) % VOCAB for i in range(48)] for j in range(3)]
    whole = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    values: dict[int, np.ndarray] = {}
    layers = whole.get_decoder().layers
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda module, args, out, i=i: values.__setitem__(i, out.detach().numpy())) for i, layer in enumerate(layers)]
    with torch.no_grad():
        whole(torch.tensor(ids))
    for hook in hooks:
        hook.remove()
    extremes = capture_kv_extremes(checkpoint, ids, 16, False)
    heads, head_dim = whole.config.num_key_value_heads, whole.config.head_dim
    for i, (_, v) in enumerate(extremes):
        expected = np.abs(values[i].reshape(-1, heads, head_dim)).max(axis=0)
        np.testing.assert_allclose(v, expected, rtol=1e-5, atol=1e-6)


def test_int4_gptq_runs_layer_by_layer(checkpoint, reference, tmp_path):
    """GPTQ runs the transformers model layer by layer from the meta device: Gemma 3's embedding scale is a
    buffer computed at init (not stored), set on the CPU by the model's own _init_weights. Random tiny
    weights quantize badly, so only the first tokens are expected to agree (as test_families' int4 check)."""
    llm = LLM(build(tmp_path, checkpoint, "quantization.mode=int4_gptq", "quantization.lm_head=none"))
    prompts = ragged_prompts(VOCAB)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    llm.close()
    first = [r.token_ids[0] == reference_greedy(reference, p)[0] for r, p in zip(results, prompts)]
    assert all(len(r.token_ids) == 8 for r in results) and any(first)
