"""A large random-weight Llama checkpoint (default: Llama-2-7B dimensions, bf16), written tensor by tensor
in small chunks straight into one safetensors file, so that making a 13.5 GB checkpoint needs well under
1 GB of memory (transformers' save_pretrained would first build the whole model in memory).

    python -m tools.checkpoints.make_large_checkpoint /tmp/llama7b            # 6.7B parameters, ~13.5 GB
    python -m tools.checkpoints.make_large_checkpoint /tmp/small --layers 2 --hidden-size 256 --intermediate-size 688 \\
        --heads 4 --kv-heads 4 --vocab-size 1000
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import click
import numpy as np

from tools.checkpoints.make_checkpoint import BOS_ID, EOS_ID, PAD_ID, _write_generation_config, make_tokenizer, size_options

LLAMA2_7B = dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, intermediate_size=11008,
                 vocab_size=32000, max_position_embeddings=4096)
CHUNK = 1 << 24  # values generated at a time (32 MiB of bf16)


def tensor_shapes(hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                  vocab_size: int, **_) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint in Hugging Face's names, in order."""
    kv = hidden_size // num_heads * num_kv_heads
    shapes = {"model.embed_tokens.weight": (vocab_size, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden_size, hidden_size),
                       p + "self_attn.k_proj.weight": (kv, hidden_size),
                       p + "self_attn.v_proj.weight": (kv, hidden_size),
                       p + "self_attn.o_proj.weight": (hidden_size, hidden_size),
                       p + "mlp.gate_proj.weight": (intermediate_size, hidden_size),
                       p + "mlp.up_proj.weight": (intermediate_size, hidden_size),
                       p + "mlp.down_proj.weight": (hidden_size, intermediate_size),
                       p + "input_layernorm.weight": (hidden_size,),
                       p + "post_attention_layernorm.weight": (hidden_size,)})
    shapes["model.norm.weight"] = (hidden_size,)
    shapes["lm_head.weight"] = (vocab_size, hidden_size)
    return shapes


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], std: float, seed: int) -> int:
    """Stream random bf16 tensors (norm weights: ones) into `path`; returns the number of parameters."""
    import torch

    offsets, start = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        offsets[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [start, start + size]}
        start += size
    header = json.dumps({"__metadata__": {"format": "pt"}, **offsets}).encode()
    header += b" " * (-len(header) % 8)
    generator = torch.Generator().manual_seed(seed)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for name, shape in shapes.items():
            total = int(np.prod(shape))
            for first in range(0, total, CHUNK):
                n = min(CHUNK, total - first)
                chunk = (torch.ones(n) if "norm" in name else torch.empty(n).normal_(0.0, std, generator=generator))
                f.write(chunk.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return sum(int(np.prod(s)) for s in shapes.values())


def make_large_checkpoint(out_dir: str | Path, std: float = 0.02, seed: int = 0, **dims) -> Path:
    """Write config.json, generation_config.json, a tokenizer and model.safetensors for a random Llama."""
    from transformers import LlamaConfig

    sizes = {**LLAMA2_7B, **{k: v for k, v in dims.items() if v is not None}}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(hidden_size=sizes["hidden_size"], num_hidden_layers=sizes["num_layers"],
                         num_attention_heads=sizes["num_heads"], num_key_value_heads=sizes["num_kv_heads"],
                         intermediate_size=sizes["intermediate_size"], vocab_size=sizes["vocab_size"],
                         max_position_embeddings=sizes["max_position_embeddings"], rms_norm_eps=1e-5,
                         bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, dtype="bfloat16",
                         architectures=["LlamaForCausalLM"])
    config.save_pretrained(str(out))
    write_safetensors(out / "model.safetensors", tensor_shapes(**sizes), std, seed)
    _write_generation_config(out)
    make_tokenizer(out, sizes["vocab_size"])
    return out


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@size_options
@click.option("--std", type=float, default=0.02, show_default=True, help="Standard deviation of the weights.")
@click.option("--seed", type=int, default=0, show_default=True)
def main(out_dir: Path, std: float, seed: int, **dims) -> None:
    """Write a random Llama checkpoint (Llama-2-7B dimensions unless overridden) with little memory."""
    path = make_large_checkpoint(out_dir, std, seed, **dims)
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
