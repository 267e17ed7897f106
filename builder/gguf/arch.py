"""GGUF architectures as data: metadata keys -> a Hugging Face config, GGUF tensor names -> HF parameter
names, and what llama.cpp's converter did to the tensors (ARCHITECTURES).

A family is one `Arch` entry: the HF model_type and architecture, which `<arch>.<key>` metadata sets which
config field, the defaults llama.cpp hard-codes where the file has no key, the tensor names (templates over
the layer index `{i}`), whether the converter permuted the Q/K rows (llama: undone here, as transformers'
GGUF loader does) and whether the stored norm weights already hold Gemma's 1 + w. Adding a family is one
entry."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from builder.gguf.reader import GGUFError, GGUFModel
from builder.gguf.repack import FLOAT_TYPES, read_float

# metadata key (after "<arch>.") -> HF config key, for every llama-like family
BASE_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
    "attention.key_length": "head_dim",
}
REQUIRED = ("block_count", "embedding_length", "attention.head_count")

# HF parameter name -> GGUF tensor name; "{i}" is the layer index
LLAMA_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
QKV_BIASES = {f"model.layers.{{i}}.self_attn.{p}_proj.bias": f"blk.{{i}}.attn_{p}.bias" for p in "qkv"}
QK_NORMS = {"model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
            "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight"}
GEMMA2_NORMS = {  # Gemma 2's four norms per layer: the HF post_attention_layernorm is a post-norm there
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
}
PHI3_TENSORS = {
    **{k: v for k, v in LLAMA_TENSORS.items() if not any(p in k for p in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                                            "up_proj"))},
    "model.layers.{i}.self_attn.qkv_proj.weight": "blk.{i}.attn_qkv.weight",
    "model.layers.{i}.mlp.gate_up_proj.weight": "blk.{i}.ffn_up.weight",
}

GPT2_TENSORS = {
    "transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
    "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
    **{f"transformer.h.{{i}}.{hf}.{part}": f"blk.{{i}}.{gguf}.{part}" for hf, gguf in (
        ("ln_1", "attn_norm"), ("attn.c_attn", "attn_qkv"), ("attn.c_proj", "attn_output"), ("ln_2", "ffn_norm"),
        ("mlp.c_fc", "ffn_up"), ("mlp.c_proj", "ffn_down")) for part in ("weight", "bias")},
}
# mixture-of-experts families: the experts stacked [E, out, in] per layer; gate and up are two tensors that HF
# stores as one [E, 2I, H] parameter ([gate | up] rows per expert): a tuple value joins its tensors along
# axis 1, after the experts' (the rows of stacked weights, the values of stacked biases [E, I])
MOE_TENSORS = {
    **{k: v for k, v in LLAMA_TENSORS.items() if ".mlp." not in k},
    "model.layers.{i}.mlp.gate.weight": "blk.{i}.ffn_gate_inp.weight",
    "model.layers.{i}.mlp.experts.gate_up_proj": ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
    "model.layers.{i}.mlp.experts.down_proj": "blk.{i}.ffn_down_exps.weight",
}
SHARED_EXPERT = {  # Qwen2-MoE: an always-on expert scaled by sigmoid(shared_expert_gate(x)), its gate [H] in the file
    **{f"model.layers.{{i}}.mlp.shared_expert.{p}_proj.weight": f"blk.{{i}}.ffn_{p}_shexp.weight"
       for p in ("gate", "up", "down")},
    "model.layers.{i}.mlp.shared_expert_gate.weight": "blk.{i}.ffn_gate_inp_shexp.weight",
}
GPT_OSS_TENSORS = {  # experts with biases; gate/up joined (by rows, and the biases along theirs) as HF's one tensor
    **{k: v for k, v in LLAMA_TENSORS.items() if ".mlp." not in k and "post_attention" not in k},
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    **{f"model.layers.{{i}}.self_attn.{p}_proj.bias": f"blk.{{i}}.attn_{g}.bias"
       for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))},
    "model.layers.{i}.self_attn.sinks": "blk.{i}.attn_sinks.weight",
    "model.layers.{i}.mlp.router.weight": "blk.{i}.ffn_gate_inp.weight",
    "model.layers.{i}.mlp.router.bias": "blk.{i}.ffn_gate_inp.bias",
    "model.layers.{i}.mlp.experts.gate_up_proj": ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
    "model.layers.{i}.mlp.experts.gate_up_proj_bias": ("blk.{i}.ffn_gate_exps.bias", "blk.{i}.ffn_up_exps.bias"),
    "model.layers.{i}.mlp.experts.down_proj": "blk.{i}.ffn_down_exps.weight",
    "model.layers.{i}.mlp.experts.down_proj_bias": "blk.{i}.ffn_down_exps.bias",
}
MOE_KEYS = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
            "expert_feed_forward_length": "moe_intermediate_size"}
MIXTRAL_KEYS = {**BASE_KEYS, "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
                "expert_feed_forward_length": "intermediate_size"}  # Mixtral's experts are its intermediate size
GPT_OSS_KEYS = {**MIXTRAL_KEYS, "attention.sliding_window": "sliding_window",
                "attention.sliding_window_pattern": "sliding_window_pattern"}
QWEN_MOE = {"decoder_sparse_step": 1, "mlp_only_layers": []}  # llama.cpp: every layer sparse

GPT2_KEYS = {"context_length": "n_positions", "block_count": "n_layer", "embedding_length": "n_embd",
             "feed_forward_length": "n_inner", "attention.head_count": "n_head",
             "attention.layer_norm_epsilon": "layer_norm_epsilon"}


@dataclass(frozen=True)
class Arch:
    """One GGUF architecture (see the module docstring)."""

    model_type: str
    architecture: str
    tensors: dict[str, str | tuple[str, ...]]  # a tuple: tensors joined along axis 1 into one HF parameter
    keys: dict[str, str] = field(default_factory=lambda: dict(BASE_KEYS))
    defaults: dict[str, Any] = field(default_factory=dict)  # what llama.cpp assumes when a key is absent
    permute_qk: bool = False  # llama.cpp's converter interleaved the Q/K rows for its rope
    norms_hold_offset: bool = False  # norm weights stored as 1 + w (Gemma): used as stored
    linears_out_in: bool = False  # HF stores its linears [in, out] (GPT-2's Conv1D); the file [out, in], as used
    derive: Callable[[dict], None] | None = None  # config fields llama.cpp computes from others (see _query_scale)
    # transformers' GGUF loader misses keys the family reads (Gemma 3: sliding pattern, local rope base, the
    # 27B's query scalar): its reference model gets the file's weights with the staged config (load_reference)
    reference_needs_config: bool = False
    # transformers' GGUF loader cannot read the family at all (Mixtral's experts in a llama file): its reference
    # model is built from the staged config and given the file's tensors as this reader dequantizes them
    transformers_reads: bool = True
    row_vectors: tuple[str, ...] = ()  # HF [1, H] parameters the file stores as [H] (Qwen2-MoE's shared gate)
    # HF holds the experts [E, in, out] with gate/up interleaved (gpt-oss): the file's [E, out, in] gate and up
    # are interleaved by rows and transposed into it (builder/gguf/checkpoint.py GGUFCheckpoint.source)
    experts_in_out: bool = False


def _query_scale(config: dict, width_scaled_depths: tuple[int, ...] = ()) -> None:
    """Gemma 2 / 3: llama.cpp scales queries by 1/sqrt(head_dim), except where the depth is one of
    `width_scaled_depths` (Gemma 3 27B's 62 layers): 1/sqrt(hidden / heads)."""
    by_width = config["num_hidden_layers"] in width_scaled_depths
    width = config["hidden_size"] // config["num_attention_heads"]
    config.setdefault("query_pre_attn_scalar", width if by_width else config.get("head_dim") or width)


def _shared_expert_size(config: dict) -> None:
    """Qwen2-MoE: llama.cpp takes the shared expert's size from feed_forward_length where the file has no
    expert_shared_feed_forward_length."""
    config.setdefault("shared_expert_intermediate_size", config.get("intermediate_size"))


def _layer_types(config: dict, arch: str, period: int) -> list[str]:
    """HF's layer_types from llama.cpp's `sliding_window_pattern` (popped from `config`): layer i slides unless it
    is the last of each period (`period` where the file has no key), or one boolean per layer (true = sliding)."""
    layers, pattern = config["num_hidden_layers"], config.pop("sliding_window_pattern", period)
    sliding = list(pattern) if isinstance(pattern, list) else [(i + 1) % int(pattern) != 0 for i in range(layers)]
    if len(sliding) != layers:
        raise GGUFError(f"{arch}.attention.sliding_window_pattern has {len(sliding)} entries for {layers} layers; "
                        f"allowed: one integer period, or one boolean per layer")
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gpt_oss(config: dict) -> None:
    """gpt-oss: llama.cpp alternates sliding and full layers, sliding first (`sliding_window_pattern` 2, or one
    boolean per layer where the file has the key); without rope scaling keys, the file's plain rope (HF's
    config would otherwise assume its YaRN default)."""
    config["layer_types"] = _layer_types(config, "gpt-oss", period=2)
    if "rope_parameters" not in config and "rope_scaling" not in config:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}


def _gemma3(config: dict) -> None:
    """Gemma 3: the file's rope base is the global layers'; the local layers' is `rope.freq_base_swa` where the
    file has it, else llama.cpp's 10000; layer i slides unless it is the last of each `sliding_window_pattern`
    (llama.cpp's 6 where the file has no key; an array of the key is per layer, true = sliding)."""
    _query_scale(config, width_scaled_depths=(62,))
    config["layer_types"] = _layer_types(config, "gemma3", period=6)
    config["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": config.pop("rope_local_base_freq", 10000.0)},
        "full_attention": {"rope_type": "default", **config.pop("rope_scaling", {}),  # scaling: global layers only
                           "rope_theta": config.pop("rope_theta")}}


GEMMA = dict(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh")
ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch("llama", "LlamaForCausalLM", LLAMA_TENSORS, permute_qk=True,
                  defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-5}),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", {**LLAMA_TENSORS, **QKV_BIASES},
                  defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-6}),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", {**LLAMA_TENSORS, **QK_NORMS},
                  defaults={"rope_theta": 1000000.0, "rms_norm_eps": 1e-6}),
    "gemma": Arch("gemma", "GemmaForCausalLM", LLAMA_TENSORS, norms_hold_offset=True,
                  defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-6, **GEMMA}),
    "gemma2": Arch("gemma2", "Gemma2ForCausalLM", {**LLAMA_TENSORS, **GEMMA2_NORMS}, norms_hold_offset=True,
                   keys={**BASE_KEYS, "attn_logit_softcapping": "attn_logit_softcapping",
                         "final_logit_softcapping": "final_logit_softcapping",
                         "attention.sliding_window": "sliding_window"},
                   defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "attn_logit_softcapping": 50.0,
                             "final_logit_softcapping": 30.0, "sliding_window": 4096, **GEMMA}, derive=_query_scale),
    "gemma3": Arch("gemma3_text", "Gemma3ForCausalLM", {**LLAMA_TENSORS, **GEMMA2_NORMS, **QK_NORMS},
                   norms_hold_offset=True, keys={**BASE_KEYS, "attention.sliding_window": "sliding_window",
                                                 "attention.sliding_window_pattern": "sliding_window_pattern",
                                                 "rope.freq_base_swa": "rope_local_base_freq"},
                   defaults={"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "sliding_window": 512, **GEMMA},
                   derive=_gemma3, reference_needs_config=True),
    "qwen2moe": Arch("qwen2_moe", "Qwen2MoeForCausalLM", {**MOE_TENSORS, **QKV_BIASES, **SHARED_EXPERT},
                     keys={**BASE_KEYS, **MOE_KEYS,
                           "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
                     defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "norm_topk_prob": False, **QWEN_MOE},
                     derive=_shared_expert_size, reference_needs_config=True,
                     row_vectors=("model.layers.{i}.mlp.shared_expert_gate.weight",)),
    "qwen3moe": Arch("qwen3_moe", "Qwen3MoeForCausalLM", {**MOE_TENSORS, **QK_NORMS}, keys={**BASE_KEYS, **MOE_KEYS},
                     defaults={"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "norm_topk_prob": True, **QWEN_MOE},
                     reference_needs_config=True),
    "gpt-oss": Arch("gpt_oss", "GptOssForCausalLM", GPT_OSS_TENSORS, keys=GPT_OSS_KEYS, experts_in_out=True,
                    defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "sliding_window": 128},
                    derive=_gpt_oss, transformers_reads=False),
    "gpt2": Arch("gpt2", "GPT2LMHeadModel", GPT2_TENSORS, keys=GPT2_KEYS, linears_out_in=True,
                 defaults={"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}),
    "phi3": Arch("phi3", "Phi3ForCausalLM", PHI3_TENSORS,
                 defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-5}),
}

# a file of one of these architectures with `<arch>.expert_count` holds a mixture of experts: another family
EXPERT_VARIANTS = {
    "llama": Arch("mixtral", "MixtralForCausalLM", MOE_TENSORS, keys=MIXTRAL_KEYS, permute_qk=True,
                  defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "sliding_window": None},
                  transformers_reads=False),
}
MOE_ARCHITECTURES = ("llama (Mixtral: llama.expert_count)", "qwen2moe", "qwen3moe", "gpt-oss")


def arch_of(model: GGUFModel) -> Arch:
    """The family entry for the file's `general.architecture` (its mixture-of-experts variant where the file
    counts experts), or a refusal listing the supported ones."""
    name = model.architecture
    experts = int(model.metadata.get(f"{name}.expert_count") or 0) > 0 or any("_exps." in t for t in model.tensors)
    if experts and name in EXPERT_VARIANTS:
        return EXPERT_VARIANTS[name]
    if experts and not _has_experts(ARCHITECTURES.get(name)):
        stacked = next((t for t in model.tensors.values() if "_exps." in t.name), None)
        what = f" (tensor {stacked.name!r}, {stacked.type} {list(stacked.shape)})" if stacked else ""
        raise GGUFError(f"{model.path}: a mixture-of-experts GGUF of architecture {name!r}{what} is not supported; "
                        f"supported mixture-of-experts architectures: {', '.join(MOE_ARCHITECTURES)}")
    if name not in ARCHITECTURES:
        raise GGUFError(f"{model.path}: GGUF architecture {name!r} is not supported; supported: "
                        f"{sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def _has_experts(arch: Arch | None) -> bool:
    return arch is not None and any("_exps." in str(gguf) for gguf in arch.tensors.values())


def hf_config(model: GGUFModel, arch: Arch) -> dict:
    """The Hugging Face config.json contents the file's metadata implies."""
    meta, prefix = model.metadata, model.architecture + "."
    missing = [prefix + key for key in REQUIRED if prefix + key not in meta]
    if missing:
        raise GGUFError(f"{model.path}: metadata lacks {missing}; every {model.architecture} GGUF has them")
    scaling = rope_scaling(model, arch)
    config: dict[str, Any] = {"model_type": arch.model_type, "architectures": [arch.architecture], **arch.defaults}
    if scaling:
        config["rope_scaling"] = scaling
    config.update({hf: meta[prefix + key] for key, hf in arch.keys.items() if prefix + key in meta})
    if "n_head" not in config:  # every family but GPT-2
        config.setdefault("num_key_value_heads", config["num_attention_heads"])
        config.setdefault("max_position_embeddings", 2048)
    config["vocab_size"] = int(meta.get(prefix + "vocab_size") or _vocab(model))
    config["tie_word_embeddings"] = "output.weight" not in model.tensors
    for key, token in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{token}_token_id" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{token}_token_id"])
    config.setdefault("pad_token_id", None)  # not a family default (Phi-3's 32000 may exceed a small vocab)
    if arch.derive:
        arch.derive(config)
    return {key: _plain(value) for key, value in config.items()}


def _vocab(model: GGUFModel) -> int:
    tokens = model.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    embed = model.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{model.path}: no vocab size (no vocab_size key, token list or token_embd.weight)")
    return embed.shape[0]


# rope scaling (see rope_scaling): metadata keys after "<arch>.rope.scaling." and the value llama.cpp reads for
# our families when the key is absent; a key set to another value is refused (llama.cpp ignores it or reads it
# differently from transformers, so no HF rope_scaling is its exact counterpart)
ROPE_PREFIX = "rope.scaling."
ROPE_TYPES = ("none", "linear", "yarn")
ROPE_READ = {"linear": ("factor",), "yarn": ("factor", "original_context_length")}
ROPE_AT_DEFAULT = {"attn_factor": 1.0, "yarn_attn_factor": None, "yarn_ext_factor": 1.0, "yarn_beta_fast": 32.0,
                   "yarn_beta_slow": 1.0, "yarn_log_multiplier": 0.0}
ROPE_INFORMATIONAL = ("type", "finetuned")
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-dimension frequency factors (Llama 3.x's llama3 scaling)
LLAMA3_TRIED = dict(high=(4.0, 2.0, 8.0), original=tuple(2 ** k for k in range(4, 21)))  # low_freq_factor: 1


def rope_scaling(model: GGUFModel, arch: Arch) -> dict | None:
    """The Hugging Face rope_scaling the file's rope scaling is exactly, None for none; a refusal naming the key or
    tensor and what is read otherwise, before any work. Read: `rope.scaling.type` linear (factor) and yarn (factor,
    original_context_length; its attention factor, beta and extrapolation keys only at llama.cpp's defaults), and
    `rope_freqs.weight` (llama.cpp's converter writes it for a llama3 rope_scaling: the llama3 parameters that
    reproduce it exactly, see _llama3)."""
    prefix = model.architecture + "." + ROPE_PREFIX
    meta = model.metadata
    kind = meta.get(prefix + "type", "none")
    has_freqs = ROPE_FREQS in model.tensors
    if arch.architecture == "GPT2LMHeadModel" and (kind != "none" or has_freqs):
        raise GGUFError(f"{model.path}: rope scaling on {model.architecture}, whose positions are learned, not rotary")
    if kind not in ROPE_TYPES:
        also = f", or {ROPE_FREQS} (llama3 factors)" if arch.model_type == "llama" else ""
        raise GGUFError(f"{model.path}: {prefix}type {kind!r} is not supported; supported: {list(ROPE_TYPES)}{also}")
    if has_freqs:
        if arch.model_type != "llama" or kind != "none":
            raise GGUFError(f"{model.path}: {ROPE_FREQS} is read in llama files without {prefix}type (llama.cpp's "
                            f"converter writes it for a llama3 rope scaling); this is {model.architecture} with "
                            f"{prefix}type {kind!r}")
        return _llama3(model)
    read = [prefix + key for key in ROPE_READ.get(kind, ())]
    for key in sorted(k[len(prefix):] for k in meta if k.startswith(prefix)):
        value = meta[prefix + key]
        at_default = key in ROPE_AT_DEFAULT and value == ROPE_AT_DEFAULT[key]
        if key in ROPE_INFORMATIONAL or prefix + key in read or at_default or (kind == "none" and key != "attn_factor"):
            continue  # type none: llama.cpp scales by attn_factor alone
        default = ROPE_AT_DEFAULT.get(key)
        at = f" (read at llama.cpp's default {default} only)" if default is not None else ""
        raise GGUFError(f"{model.path}: {prefix}{key} = {value!r} is not supported with rope scaling {kind!r}{at}; "
                        f"read: {read or 'none'}")
    if kind == "none":
        return None
    missing = [key for key in read if key not in meta]
    if missing:
        raise GGUFError(f"{model.path}: rope scaling {kind!r} without {missing}")
    scaling = {"rope_type": kind, "factor": float(meta[prefix + "factor"])}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(meta[prefix + "original_context_length"])
    return scaling


def _llama3(model: GGUFModel) -> dict | None:
    """The llama3 rope_scaling whose factors, computed as llama.cpp's converter computes them, equal the file's
    rope_freqs.weight bit for bit (llama.cpp divides each rotary frequency by its factor; transformers' llama3
    scaling multiplies by the same smoothed ratio, so the two tables agree to float32 rounding). The factor is the
    largest entry; low/high_freq_factor and original_max_position_embeddings are not in the file: Llama 3.x's
    (1, 4, 8192), a grid of powers of two, and the values solved from the smoothed entries are tried. All ones:
    no scaling. Factors no llama3 scaling reproduces are refused (never dropped)."""
    meta, arch, tensor = model.metadata, model.architecture + ".", model.tensors[ROPE_FREQS]
    if tensor.type not in FLOAT_TYPES:
        raise GGUFError(f"{model.path}: {ROPE_FREQS} is stored as {tensor.type}; supported: {list(FLOAT_TYPES)}")
    factors = read_float(tensor.type, tensor.data).reshape(-1)
    base = float(meta.get(arch + "rope.freq_base", 10000.0))
    heads = int(meta[arch + "attention.head_count"])
    dim = int(meta.get(arch + "rope.dimension_count") or meta.get(arch + "attention.key_length")
              or int(meta[arch + "embedding_length"]) // heads)
    if factors.shape != (dim // 2,) or not np.all(np.isfinite(factors)) or factors.min() <= 0:
        raise GGUFError(f"{model.path}: {ROPE_FREQS} has shape {tensor.shape} (min "
                        f"{factors.min():g}); expected {dim // 2} positive factors, one per rotary frequency")
    if np.all(factors == 1):
        return None
    factor = float(factors.max())
    for low, high, original in _llama3_candidates(factors, factor, base, dim):
        if np.array_equal(_converter_factors(base, dim, factor, low, high, original), factors):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    shown = np.array2string(factors, precision=5, threshold=16, max_line_width=10 ** 4)
    raise GGUFError(f"{model.path}: {ROPE_FREQS} ({shown}) is not what llama.cpp's converter writes for any llama3 "
                    f"rope scaling tried (factor {factor:g}, low_freq_factor 1, high_freq_factor "
                    f"{LLAMA3_TRIED['high']} or solved, original_max_position_embeddings 16..{2 ** 20} or solved); "
                    f"supported: the factors of a llama3 rope scaling")


def _llama3_candidates(factors: np.ndarray, factor: float, base: float, dim: int):
    """(low, high, original) to try: the grid, then high and original solved (low 1) from the smoothed entries,
    where the converter's 1 / factor_i = (1 - s) / factor + s and s = (original / wavelength - low) / (high - low)."""
    for original in (8192, *LLAMA3_TRIED["original"]):
        for high in LLAMA3_TRIED["high"]:
            yield 1.0, high, original
    wavelength = 2 * np.pi * base ** (np.arange(0, dim, 2) / dim)
    smooth = (factors > 1) & (factors < factor)
    s = (1 / factors[smooth].astype(np.float64) - 1 / factor) / (1 - 1 / factor)
    if smooth.sum() >= 2:  # original / w - s * high = 1 - s, least squares in (original, high)
        a = np.stack([1 / wavelength[smooth], -s], axis=1)
        (original, high), *_ = np.linalg.lstsq(a, 1 - s, rcond=None)
        if original > 0 and high > 1:
            yield 1.0, float(f"{high:.6g}"), int(round(original))
    for w, si in zip(wavelength[smooth], s):  # one smoothed entry: high 4 or original 8192 assumed
        yield 1.0, 4.0, int(round(w * (1 + 3 * si)))
        if si > 0:
            yield 1.0, float(f"{1 + (8192 / w - 1) / si:.6g}"), 8192


def _converter_factors(base: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) computes it for
    a llama3 rope scaling: the same float32 torch operations in the same order."""
    import math

    import torch

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelength, high_wavelength = original / low, original / high
    out = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < high_wavelength:
            out.append(1)
        elif wavelength > low_wavelength:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def reference_needs_config(model: GGUFModel, arch: Arch) -> bool:
    """transformers' GGUF loader reads the file's weights but not all of its metadata: the family's keys
    (Arch.reference_needs_config) or, for every family, rope scaling (it drops rope_freqs.weight and reads
    rope.scaling keys for gpt-oss only). Its reference model then gets the staged config."""
    return arch.reference_needs_config or rope_scaling(model, arch) is not None


def _plain(value: Any) -> Any:
    return float(value) if isinstance(value, (float, np.floating)) else value


def tensor_names(model: GGUFModel, arch: Arch, layers: int) -> dict[str, tuple[str, ...]]:
    """HF parameter name -> the GGUF tensor(s) holding it (several: joined along axis 1, gate then up) for every
    tensor of the file; one the family does not name is refused (it would be silently ignored otherwise)."""
    names = {}
    for hf, gguf in arch.tensors.items():
        parts = (gguf,) if isinstance(gguf, str) else gguf
        for i in (range(layers) if "{i}" in hf else [None]):
            found = [p.format(i=i) for p in parts if p.format(i=i) in model.tensors]
            if len(found) == len(parts):
                names[hf.format(i=i)] = tuple(found)
            elif found:
                missing = sorted({p.format(i=i) for p in parts} - set(found))
                raise GGUFError(f"{model.path}: {found} without {missing}; {hf.format(i=i)} is made of both")
    unknown = sorted(set(model.tensors) - {p for parts in names.values() for p in parts} - {ROPE_FREQS})  # read into the config
    if unknown:
        raise GGUFError(f"{model.path}: tensors the {model.architecture} mapping does not know: {unknown[:8]}"
                        f"{' ...' if len(unknown) > 8 else ''}")
    return names


def unpermute_rows(n: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation: hf_rows = gguf_rows[order] (as transformers'
    LlamaTensorProcessor reverses it)."""
    rows = np.arange(n)
    return rows.reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)
