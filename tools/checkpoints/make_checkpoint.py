"""Small random-weight Hugging Face checkpoints, made offline, for tests, demos and benchmarks.

A checkpoint directory holds config.json, safetensors weights (sharded with an index when asked),
generation_config.json, and a byte-level BPE tokenizer trained on Python standard library sources.

    python -m tools.checkpoints.make_checkpoint checkpoints/random/tiny --preset tiny
"""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from tokenizers import Tokenizer

FAMILIES = ("llama", "mistral", "qwen2", "qwen3_moe", "gemma3")
DTYPES = ("float32", "float16", "bfloat16")

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, vocab_size=512, max_position_embeddings=512,
    ),
    "bench150m": dict(
        hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
        intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048,
    ),
    "llama1b": dict(  # Llama-3.2-1B dimensions (tied embeddings, vocab 128256), ~1.24B parameters
        hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        intermediate_size=8192, vocab_size=128256, max_position_embeddings=2048, tie_word_embeddings=True,
    ),
    "moe1b": dict(  # Qwen3-MoE dimensions scaled down: ~1.0B parameters, ~0.2B active per token (4 of 32 experts)
        family="qwen3_moe", hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4, head_dim=64,
        intermediate_size=3072, vocab_size=32000, max_position_embeddings=2048,
        moe=dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=768, norm_topk_prob=True),
    ),
}

_CORPUS_CHARS_PER_TOKEN = 160
_MIN_CORPUS_CHARS = 64_000
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_STDLIB_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _training_corpus(max_chars: int) -> list[str]:
    texts: list[str] = []
    total = 0
    for path in _stdlib_sources():
        if total >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
    if not texts:
        raise RuntimeError("no Python standard library sources found to train the tokenizer on")
    return texts


def _train_bpe(vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _training_corpus(max(_MIN_CORPUS_CHARS, vocab_size * _CORPUS_CHARS_PER_TOKEN))
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)],
    )
    shortfall = vocab_size - tokenizer.get_vocab_size()
    if shortfall > 0:
        tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(shortfall)])
    return tokenizer


def make_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer of exactly `vocab_size` tokens and save it to `out_dir`.

    Ids 0-3 are `<unk>`, `<s>` (bos, prepended on encode), `</s>` (eos) and `<pad>`. Writes
    tokenizer.json and tokenizer_config.json (with a simple chat template)."""
    from transformers import PreTrainedTokenizerFast

    min_size = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_size:
        raise ValueError(f"vocab_size {vocab_size} is below the byte-level minimum of {min_size}")
    tokenizer = _train_bpe(vocab_size)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained tokenizer has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(str(out_dir), save_jinja_files=False)


def _rope_parameters(rope_theta: float, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        scaling = dict(rope_scaling)
        if "type" in scaling:
            scaling.setdefault("rope_type", scaling.pop("type"))
        params.update(scaling)
    return params


GEMMA3_LOCAL = dict(sliding_window=16, rope_local_base_freq=10000.0)  # small window, Gemma 3's local rope base


def _build_config(family: str, attention_bias: bool, **common: Any):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3MoeConfig

    if family == "llama":
        return LlamaConfig(attention_bias=attention_bias, **common)
    if attention_bias and family == "mistral":
        raise ValueError("mistral has no attention biases; use family='llama' with attention_bias=True")
    if family == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if family == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    if family == "qwen3_moe":  # `moe` sizes: num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob
        return Qwen3MoeConfig(attention_bias=attention_bias, use_sliding_window=False, **common)
    if family == "gemma3":  # 5 sliding layers per global one; a shorter stack still ends on a global layer
        return _gemma3_config(Gemma3TextConfig, attention_bias, **common)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _gemma3_config(config_class: type, attention_bias: bool, **common: Any):
    """Gemma 3 text: `rope_parameters` (rope_theta and rope_scaling) go to the global layers, the sliding
    ones get GEMMA3_LOCAL's base; the softmax scale is 1/sqrt(head_dim), as in the released models."""
    global_rope = common.pop("rope_parameters")
    head_dim = common.get("head_dim") or common["hidden_size"] // common["num_attention_heads"]
    rope = {"full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL["rope_local_base_freq"]}}
    return config_class(attention_bias=attention_bias, sliding_window=GEMMA3_LOCAL["sliding_window"],
                        sliding_window_pattern=min(6, common["num_hidden_layers"]), rope_parameters=rope,
                        query_pre_attn_scalar=head_dim, **common)


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    return getattr(torch, dtype)


def _write_generation_config(out_dir: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(str(out_dir))


def make_checkpoint(
    out_dir: str | Path,
    *,
    family: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    dtype: str = "float32",
    initializer_range: float = 0.02,
    seed: int = 0,
    shard_size: str | int | None = None,
    head_dim: int | None = None,
    moe: dict[str, Any] | None = None,
) -> Path:
    """Write a random-weight checkpoint (weights, configs, tokenizer) to `out_dir` and return its path.

    `rope_scaling` is a Hugging Face rope dict such as {"rope_type": "llama3", "factor": 8.0, ...};
    it becomes the config's `rope_parameters` together with `rope_theta`. `shard_size` (e.g. "200KB")
    splits the weights into several safetensors files with model.safetensors.index.json. Qwen2 always
    has q/k/v biases; `attention_bias` adds q/k/v/o biases to llama. `moe` holds the mixture-of-experts
    config fields of family qwen3_moe (num_experts, num_experts_per_tok, moe_intermediate_size, ...)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    torch_dtype = _torch_dtype(dtype)
    config = _build_config(
        family,
        attention_bias,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=_rope_parameters(rope_theta, rope_scaling),
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **({"head_dim": head_dim} if head_dim is not None else {}),
        **(moe or {}),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False).eval()
    model.to(torch_dtype)
    model.config.dtype = torch_dtype
    out.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if shard_size is not None:
        save_kwargs["max_shard_size"] = shard_size
    model.save_pretrained(str(out), **save_kwargs)
    _write_generation_config(out)
    make_tokenizer(out, vocab_size)
    return out


def count_parameters(checkpoint_dir: str | Path) -> int:
    """Number of weights stored in a checkpoint's safetensors files (tied weights count once)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def _parse_rope_scaling(ctx: click.Context, param: click.Parameter, value: str | None) -> dict | None:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise click.BadParameter(f"not valid JSON: {err}") from err
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object")
    return parsed


SIZE_OPTIONS = [click.option("--hidden-size", type=int), click.option("--layers", "num_layers", type=int),
                click.option("--heads", "num_heads", type=int), click.option("--kv-heads", "num_kv_heads", type=int),
                click.option("--intermediate-size", type=int), click.option("--vocab-size", type=int)]


def size_options(command):
    """The model-size options every checkpoint maker takes (unset: the maker's default sizes)."""
    for option in reversed(SIZE_OPTIONS):
        command = option(command)
    return command


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--family", type=click.Choice(FAMILIES), default="llama", show_default=True)
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True,
              help="Base sizes; the size options below override them.")
@size_options
@click.option("--head-dim", type=int)
@click.option("--max-position-embeddings", type=int)
@click.option("--rope-theta", type=float, default=10000.0, show_default=True)
@click.option("--rope-scaling", callback=_parse_rope_scaling,
              help='JSON, e.g. \'{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, '
                   '"high_freq_factor": 4.0, "original_max_position_embeddings": 64}\'')
@click.option("--tie-word-embeddings/--no-tie-word-embeddings", default=False, show_default=True)
@click.option("--attention-bias/--no-attention-bias", default=False, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--initializer-range", type=float, default=0.02, show_default=True)
@click.option("--shard-size", help='Maximum shard size, e.g. "100MB"; unsharded when omitted.')
@click.option("--seed", type=int, default=0, show_default=True)
def main(out_dir: Path, preset: str, **options: Any) -> None:
    """Write a random-weight Hugging Face checkpoint to OUT_DIR."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    sizes = dict(PRESETS[preset])
    sizes.update({k: v for k, v in options.items() if k in sizes and v is not None})
    rest = {k: v for k, v in options.items() if k not in sizes}
    path = make_checkpoint(out_dir, **sizes, **rest)
    click.echo(f"{path}\t{count_parameters(path):,} parameters")


if __name__ == "__main__":
    main()
