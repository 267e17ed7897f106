"""Shared by the LoRA tests: a tiny Llama engine built with `lora:` and random PEFT adapters (B non-zero)."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_lora_engine(checkpoint: Path, out: Path, *, max_rank: int = 8, max_adapters: int = 3,
                      targets: list[str] = ALL, fuse: bool = True, max_batch_size: int = 4,
                      overrides: tuple[str, ...] = ()) -> Path:
    from builder.build import build_engine
    from builder.recipe import load_recipe

    recipe = load_recipe(base={"model": str(checkpoint), "verify": {"enabled": "off"},
                               "lora": {"max_rank": max_rank, "max_adapters": max_adapters, "targets": targets},
                               "passes": {"fuse_qkv": fuse, "fuse_gate_up": fuse}},
                         overrides=["limits.max_seq_len=96", f"limits.max_batch_size={max_batch_size}", *overrides])
    return build_engine(recipe, out, log=lambda _: None)


def make_adapter(checkpoint: Path, out: Path, *, r: int = 4, alpha: int = 8, targets: list[str] = ALL,
                 seed: int = 0, **extra) -> Path:
    """A PEFT LoRA adapter of random A and B (init_lora_weights=False) saved at `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B is zeros-free but small: scale it so the adapter moves the logits visibly
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=8)
def reference_model(checkpoint: Path, adapter: Path | None):
    """transformers float32 on the checkpoint, wrapped in PeftModel with `adapter` when given."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def reference_logits(checkpoint: Path, adapter: Path | None, ids: list[int]) -> np.ndarray:
    """transformers (+ PeftModel) float32 logits at every position of `ids`."""
    import torch

    with torch.no_grad():
        return reference_model(checkpoint, adapter)(torch.tensor([ids])).logits[0].numpy()


def reference_greedy(checkpoint: Path, adapter: Path | None, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(reference_logits(checkpoint, adapter, out)[-1].argmax()))
    return out[len(ids):]
