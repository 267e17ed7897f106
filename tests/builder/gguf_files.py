"""Tiny GGUF files the GGUF tests write themselves with the `gguf` package: a random-weight model of one of
the supported families, its tensors in chosen GGML types, and a byte-level BPE tokenizer in the metadata.

Types `gguf` quantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) come from its quantizer; the K-quants are random
blocks whose float16 scales are set small and finite (`random_blocks`), dequantized by `gguf` as the
oracle. The Llama family's Q/K rows are permuted as llama.cpp's converter does."""
from __future__ import annotations

from pathlib import Path

import numpy as np

QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# byte offsets of the float16 scale fields (d, dmin / m) inside one block of each type
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Random bytes [rows, row bytes] of a block type, its float16 scales replaced by small finite ones."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in SCALE_FIELDS[type_name]:
        d = (rng.uniform(0.2, 1.0, len(raw)) * scale).astype(np.float16)
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    if type_name == "IQ1_M":
        set_iq1_m_scales(raw, (rng.uniform(0.2, 1.0, len(raw)) * scale).astype(np.float16))
    return raw.reshape(rows, -1)


def encode(value: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """A float32 weight in `type_name`'s bytes (a K-quant: random blocks of the same shape)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if type_name in QUANTIZABLE:
        return quantize(value.astype(np.float32), GGMLQuantizationType[type_name])
    return random_blocks(type_name, value.shape[0], value.shape[1], rng)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute of Q / K rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_tokens(vocab: int) -> tuple[list[str], list[int]]:
    """GPT-2 byte-level tokens (256 bytes, then <|endoftext|>, then fillers up to `vocab`) and their types."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    by_byte = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}  # GPT-2's bytes_to_unicode
    tokens = [by_byte[b] for b in range(256)] + ["<|endoftext|>"] + [m.replace(" ", "") for m in MERGES]
    tokens += [f"<filler_{i}>" for i in range(vocab - len(tokens))]
    types = [1] * 256 + [3] + [1] * len(MERGES) + [4] * (vocab - 257 - len(MERGES))
    return tokens, types


MERGES = ["Ġ t", "h e", "Ġ a"]
LLAMA_TENSORS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
                 "up": "ffn_up", "down": "ffn_down"}


def start_writer(path: Path, arch: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int):
    """A GGUFWriter with the shape keys every family's file has and the byte-level BPE tokenizer (BOS/EOS 256)."""
    from gguf import GGUFWriter

    head_dim = hidden // heads
    writer = GGUFWriter(str(path), arch=arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    tokens, token_types = byte_tokens(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(256)
    return writer


def write_llama(path: Path, types: dict[str, str], hidden: int = 64, inter: int = 128, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, vocab: int = 320, tied: bool = True, seed: int = 0,
                arch: str = "llama") -> Path:
    """A random llama-family GGUF (`arch` llama, qwen2, qwen3, gemma2, gemma3 or phi3 naming; qwen2 gets q/k/v
    biases, qwen3 q/k norms, gemma2 post-norms and soft-capping keys (norms are stored as llama.cpp stores them,
    1 + w), gemma3 post-norms, q/k norms, a window of 4 and one global layer per 3, local rope base 100,
    phi3 fused attn_qkv and ffn_up = [gate | up]). `types` maps "q", "k", "v", "o", "gate", "up", "down", "embed", "output" to a GGML type name
    (default Q8_0 for the linears and the embedding, F32 for norms and biases)."""
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    writer = start_writer(path, arch, layers, hidden, inter, heads, kv_heads, vocab)
    writer.add_pad_token_id(256)
    if arch == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", 50.0)
        writer.add_float32("gemma2.final_logit_softcapping", 30.0)
        writer.add_uint32("gemma2.attention.sliding_window", 8)
    if arch == "gemma3":
        writer.add_sliding_window(4)
        writer.add_sliding_window_pattern(3)
        writer.add_rope_freq_base_swa(100.0)

    def tensor(name: str, value: np.ndarray, type_name: str = "F32") -> None:
        data = encode(value, type_name, rng) if value.ndim == 2 else value.astype(np.float32)
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[type_name if value.ndim == 2 else "F32"])

    def weight(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0, 0.5 / np.sqrt(cols), (rows, cols)).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    tensor("token_embd.weight", weight(vocab, hidden) * 20, types.get("embed", "Q8_0"))
    for i in range(layers):
        p = f"blk.{i}."
        shapes = {"q": (heads * head_dim, hidden), "k": (kv_heads * head_dim, hidden), "v": (kv_heads * head_dim, hidden),
                  "o": (hidden, heads * head_dim), "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        tensor(p + "attn_norm.weight", norm(hidden))
        tensor(p + "ffn_norm.weight", norm(hidden))
        values = {key: weight(*shape) for key, shape in shapes.items()}
        if arch == "phi3":  # fused in the file: [q | k | v] and [gate | up]
            values["q"] = np.concatenate([values.pop("q"), values.pop("k"), values.pop("v")])
            values["up"] = np.concatenate([values.pop("gate"), values["up"]])
        if arch in ("gemma2", "gemma3"):
            tensor(p + "post_attention_norm.weight", norm(hidden))
            tensor(p + "post_ffw_norm.weight", norm(hidden))
        for key, value in values.items():
            if arch == "llama" and key in ("q", "k"):
                value = permute(value, heads if key == "q" else kv_heads)
            name = "attn_qkv" if arch == "phi3" and key == "q" else LLAMA_TENSORS[key]
            tensor(p + name + ".weight", value, types.get(key, "Q8_0"))
            if arch == "qwen2" and key in ("q", "k", "v"):
                tensor(p + LLAMA_TENSORS[key] + ".bias", 0.1 * rng.standard_normal(shapes[key][0]).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            tensor(p + "attn_q_norm.weight", norm(head_dim))
            tensor(p + "attn_k_norm.weight", norm(head_dim))
    tensor("output_norm.weight", norm(hidden))
    if not tied:
        tensor("output.weight", weight(vocab, hidden), types.get("output", "Q8_0"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gpt2(path: Path, types: dict[str, str], hidden: int = 64, layers: int = 2, heads: int = 4,
               vocab: int = 320, seed: int = 0) -> Path:
    """A random GPT-2 GGUF: weights [out, in] as llama.cpp's converter writes them (HF's Conv1D transposed),
    LayerNorms with biases, learned positions, tied embeddings. `types` maps "qkv", "o", "up", "down" to a
    GGML type (default Q8_0); the MLP is 4 x hidden and 1024 positions (what transformers assumes for GPT-2)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch="gpt2")
    writer.add_block_count(layers)
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(4 * hidden)
    writer.add_head_count(heads)
    writer.add_layer_norm_eps(1e-5)
    tokens, token_types = byte_tokens(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(256)

    def add(name: str, value: np.ndarray, type_name: str = "F32") -> None:
        data = encode(value, type_name, rng) if type_name != "F32" else value.astype(np.float32)
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[type_name])

    def small(*shape: int) -> np.ndarray:
        return (0.3 / np.sqrt(shape[-1]) * rng.standard_normal(shape)).astype(np.float32)

    add("token_embd.weight", small(vocab, hidden) * 10)
    add("position_embd.weight", small(1024, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            add(p + norm + ".weight", 1 + 0.1 * rng.standard_normal(hidden).astype(np.float32))
            add(p + norm + ".bias", small(hidden))
        for key, name, shape in (("qkv", "attn_qkv", (3 * hidden, hidden)), ("o", "attn_output", (hidden, hidden)),
                                 ("up", "ffn_up", (4 * hidden, hidden)), ("down", "ffn_down", (hidden, 4 * hidden))):
            add(p + name + ".weight", small(*shape), types.get(key, "Q8_0"))
            add(p + name + ".bias", small(shape[0]))
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(hidden).astype(np.float32))
    add("output_norm.bias", small(hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


MOE_FAMILIES = ("llama", "qwen2moe", "qwen3moe", "gpt-oss")  # llama with llama.expert_count: Mixtral


def write_moe(path: Path, arch: str, types: dict[str, str], hidden: int = 64, moe_inter: int = 64, experts: int = 4,
              top_k: int = 2, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 320,
              shared_inter: int = 96, seed: int = 0) -> dict[str, np.ndarray]:
    """A random mixture-of-experts GGUF as llama.cpp's converter writes one: `arch` llama (Mixtral: Q/K rows
    permuted, `llama.expert_count`), qwen2moe (q/k/v biases, a shared expert `ffn_*_shexp` with its gate
    `ffn_gate_inp_shexp` [H]), qwen3moe (q/k norms) or gpt-oss (q/k/v/o biases, attention sinks, a biased router,
    expert biases, `post_attention_norm`, a window of 4 on every other layer; experts MXFP4 by default); every
    layer sparse, the experts stacked [E, out, in] in `ffn_{gate,up,down}_exps`, the router `ffn_gate_inp` F32.
    `types` maps "gate_exps", "up_exps", "down_exps",
    "shexp" (the shared expert's linears), "attn" (q/k/v/o), "embed" and "output" to a GGML type (default Q8_0;
    experts Q4_0). Returns the model the file was written from as Hugging Face parameters (float32), the values
    the file holds (gguf's own dequantize of the written bytes), in HF's layout: gate_up_proj [E, 2I, H] as
    [gate | up] rows (gpt-oss: [E, H, 2I], gate and up interleaved, as its converter splits them), Q/K rows in
    HF order, the shared gate [1, H]; untied (`output.weight`)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    writer = start_writer(path, arch, layers, hidden, moe_inter if arch == "llama" else 4 * hidden, heads, kv_heads,
                          vocab)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(top_k)
    if arch != "llama":
        writer.add_expert_feed_forward_length(moe_inter)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(shared_inter)
    if arch == "gpt-oss":
        writer.add_sliding_window(4)
    oss = arch == "gpt-oss"
    expert_type = "MXFP4" if oss else "Q4_0"
    hf: dict[str, np.ndarray] = {}

    def tensor(name: str, value: np.ndarray, type_name: str = "F32") -> np.ndarray:
        """Writes `value` as `type_name`; returns what the file holds, as float32."""
        kind = GGMLQuantizationType[type_name]
        data = value.astype(np.float32) if type_name == "F32" else encode_any(value, type_name, rng)
        writer.add_tensor(name, data, raw_dtype=kind)
        return data if type_name == "F32" else dequantize(data, kind).astype(np.float32)

    def weight(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.5 / np.sqrt(shape[-1]), shape).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    embed = weight(vocab, hidden) * 20
    hf["model.embed_tokens.weight"] = tensor("token_embd.weight", embed, types.get("embed", "Q8_0"))
    for i in range(layers):
        p, m = f"blk.{i}.", f"model.layers.{i}."
        hf[m + "input_layernorm.weight"] = tensor(p + "attn_norm.weight", norm(hidden))
        hf[m + "post_attention_layernorm.weight"] = tensor(p + ("post_attention_norm" if oss else "ffn_norm") +
                                                           ".weight", norm(hidden))
        for key, rows, cols, count in (("q", hidden, hidden, heads), ("k", kv_heads * head_dim, hidden, kv_heads),
                                       ("v", kv_heads * head_dim, hidden, None), ("o", hidden, hidden, None)):
            value = weight(rows, cols)
            stored = permute(value, count) if arch == "llama" and count else value
            held = tensor(p + LLAMA_TENSORS[key] + ".weight", stored, types.get("attn", "Q8_0"))
            hf[m + f"self_attn.{key}_proj.weight"] = _unpermute(held, count) if arch == "llama" and count else held
            if (arch == "qwen2moe" and key != "o") or oss:
                hf[m + f"self_attn.{key}_proj.bias"] = tensor(p + LLAMA_TENSORS[key] + ".bias",
                                                              0.1 * rng.standard_normal(rows).astype(np.float32))
        if arch == "qwen3moe":
            hf[m + "self_attn.q_norm.weight"] = tensor(p + "attn_q_norm.weight", norm(head_dim))
            hf[m + "self_attn.k_norm.weight"] = tensor(p + "attn_k_norm.weight", norm(head_dim))
        router = "mlp.router." if oss else "mlp.gate."
        hf[m + router + "weight"] = tensor(p + "ffn_gate_inp.weight", weight(experts, hidden) * 4)
        gate, up, down = (tensor(p + f"ffn_{key}_exps.weight", weight(experts, rows, cols),
                                 types.get(f"{key}_exps", expert_type))
                          for key, rows, cols in (("gate", moe_inter, hidden), ("up", moe_inter, hidden),
                                                  ("down", hidden, moe_inter)))
        if oss:  # HF: [E, in, out], gate and up interleaved (column 2j gate j, 2j + 1 up j), biases likewise
            hf[m + "self_attn.sinks"] = tensor(p + "attn_sinks.weight", rng.normal(0, 1, heads))
            hf[m + router + "bias"] = tensor(p + "ffn_gate_inp.bias", 0.5 * rng.standard_normal(experts))
            biases = [tensor(p + f"ffn_{k}_exps.bias", 0.1 * rng.standard_normal((experts, size)))
                      for k, size in (("gate", moe_inter), ("up", moe_inter), ("down", hidden))]
            interleaved = np.stack([gate, up], axis=2).reshape(experts, -1, hidden)  # [E, 2I, H]
            hf[m + "mlp.experts.gate_up_proj"] = np.ascontiguousarray(interleaved.swapaxes(1, 2))
            hf[m + "mlp.experts.gate_up_proj_bias"] = np.stack(biases[:2], axis=2).reshape(experts, -1)
            hf[m + "mlp.experts.down_proj"] = np.ascontiguousarray(down.swapaxes(1, 2))
            hf[m + "mlp.experts.down_proj_bias"] = biases[2]
        else:
            hf[m + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
            hf[m + "mlp.experts.down_proj"] = down
        if arch == "qwen2moe":
            for key, shape in (("gate", (shared_inter, hidden)), ("up", (shared_inter, hidden)),
                               ("down", (hidden, shared_inter))):
                hf[m + f"mlp.shared_expert.{key}_proj.weight"] = tensor(p + f"ffn_{key}_shexp.weight", weight(*shape),
                                                                        types.get("shexp", "Q8_0"))
            hf[m + "mlp.shared_expert_gate.weight"] = tensor(p + "ffn_gate_inp_shexp.weight", weight(hidden))[None]
    hf["model.norm.weight"] = tensor("output_norm.weight", norm(hidden))
    hf["lm_head.weight"] = tensor("output.weight", weight(vocab, hidden), types.get("output", "Q8_0"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def encode_any(value: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """A float32 weight of any rank in `type_name`'s bytes: quantized where `gguf` quantizes the type, random
    blocks of the same shape for a K-quant (`random_blocks`), zero bytes for any other type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    if type_name in QUANTIZABLE:
        return quantize(value.astype(np.float32), GGMLQuantizationType[type_name])
    rows, cols = int(np.prod(value.shape[:-1])), value.shape[-1]
    if type_name in SCALE_FIELDS:
        return random_blocks(type_name, rows, cols, rng).reshape(*value.shape[:-1], -1)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return np.zeros((*value.shape[:-1], cols // block * size), np.uint8)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `permute` (transformers' LlamaTensorProcessor reverse permutation)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# the i-quants' and ternary types' float16 d (IQ1_M's is spread over its scales' top nibbles: set_iq1_m_scales)
SCALE_FIELDS.update({"IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ2_XXS": (0,),
                     "IQ2_XS": (0,), "IQ2_S": (0,), "IQ1_S": (0,), "IQ1_M": (), "TQ1_0": (52,), "TQ2_0": (64,)})


def set_iq1_m_scales(raw: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M blocks [blocks, 56] with their float16 d set to `d` [blocks]: its 16 bits are the top nibbles of
    the four uint16 scale words (bytes 48..55), its lowest bits in the first word."""
    words = np.ascontiguousarray(raw[:, 48:56]).view("<u2")
    nibbles = d.view(np.uint16)[:, None] >> np.array([0, 4, 8, 12], np.uint16) & np.uint16(0xF)
    raw[:, 48:56] = ((words & np.uint16(0x0FFF)) | (nibbles << np.uint16(12))).view(np.uint8)
