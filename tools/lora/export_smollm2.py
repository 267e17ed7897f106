"""Write SmolLM2-135M-Instruct's float32 weights (transformers' GGUF loader, de-quantized) as a Hugging Face
checkpoint directory, tokenizer and chat template included: the base an exact-float LoRA engine is built from,
so its greedy tokens can be held equal to transformers + PeftModel's (the GGUF engine keeps Q4_1 weights).

    python -m tools.lora.export_smollm2 --out checkpoints/lora/smollm2-f32
"""
from __future__ import annotations

from pathlib import Path

import click

from tools.lora.train_smollm2 import GGUF_DIR, GGUF_FILE, load_base


@click.command()
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("checkpoints/lora/smollm2-f32"),
              show_default=True, help="Checkpoint directory to write.")
@click.option("--gguf-dir", default=GGUF_DIR, show_default=True)
@click.option("--gguf-file", default=GGUF_FILE, show_default=True)
def main(out_dir: Path, gguf_dir: str, gguf_file: str) -> None:
    """Save the float32 base checkpoint."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_base(gguf_dir, gguf_file)
    config = model.config
    if hasattr(config, "quantization_config"):  # transformers refuses to save a GGUF-loaded model as it is
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    click.echo(f"wrote {out_dir}")


if __name__ == "__main__":
    main()
