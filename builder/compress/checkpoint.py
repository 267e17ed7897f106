"""Reading the teacher and writing the student: a Hugging Face checkpoint folder (config, safetensors, tokenizer,
chat template, generation config) plus compress.json (the plan, the kept indices with their scores, the training
history), written into a scratch folder and renamed into place file by file."""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path

import torch

from builder.compress.plan import CompressError

REPORT_FILE = "compress.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
# what a checkpoint's tokenizer and chat template are stored in (a package's __init__.py or a README beside a
# GGUF teacher is not the student's)
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template*", "vocab.*",
                   "merges.txt", "*.model", "*.tiktoken")
SKIPPED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", REPORT_FILE}


def checkpoint_dir(path: str | Path, what: str, gguf_file: str | None = None) -> Path:
    """`path` as a checkpoint folder, or a CompressError saying what a checkpoint folder holds."""
    path = Path(path)
    needed = path / (gguf_file or "config.json")
    if not needed.is_file():
        raise CompressError(f"{what} {path}: no {needed.name} there; give a Hugging Face checkpoint folder "
                            f"(config.json, *.safetensors, tokenizer files), or a folder and --gguf-file")
    return path


def load_config(path: Path, gguf_file: str | None = None):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, gguf_file=gguf_file)


def load_model(path: Path, device: str = "cpu", gguf_file: str | None = None):
    """The model in float32 (training and slicing precision), eval mode, on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    if gguf_file is not None:  # transformers dequantized the GGUF tensors: the model is plain float32 now
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise CompressError(f"{path}: {type(model).__name__} is not a Llama-family decoder (model.layers); "
                            f"engine-compress prunes Llama-family checkpoints")
    return model.to(device).eval()


def load_tokenizer(path: Path, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)


def save_checkpoint(model, tokenizer, source: Path, out: Path, report: dict) -> Path:
    """Write `model` (float32 safetensors) with the teacher's tokenizer files and `report` into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / ".writing"
    shutil.rmtree(scratch, ignore_errors=True)
    model.to("cpu").save_pretrained(scratch, safe_serialization=True)
    tokenizer.save_pretrained(scratch)
    for extra in source.iterdir():  # the teacher's own tokenizer / template files, byte for byte; nothing else
        if extra.is_file() and extra.name not in SKIPPED and not extra.name.endswith(WEIGHT_SUFFIXES) \
                and any(fnmatch.fnmatch(extra.name, pattern) for pattern in TOKENIZER_FILES):
            shutil.copyfile(extra, scratch / extra.name)
    (scratch / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    written = {item.name for item in scratch.iterdir()}
    for name in sorted(written):
        os.replace(scratch / name, out / name)
    for stale in out.glob("*.safetensors*"):  # shards of an earlier, differently sharded student
        if stale.name not in written:
            stale.unlink()
    scratch.rmdir()
    return out
