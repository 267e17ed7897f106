"""The engine's tokenizer files from a GGUF file's metadata, through transformers' own GGUF tokenizer
conversion: the tokenizer keys are written into a small GGUF of their own, which
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` converts, and `save_pretrained` writes
tokenizer.json, tokenizer_config.json (bos/eos, add_bos, chat_template) and chat_template.jinja.

(transformers ignores `tokenizer.ggml.pre`; a llama.cpp-exact version of this one function replaces it.)"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def write_tokenizer_files(metadata: dict[str, Any], out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja for `metadata` (every GGUF key
    -> plain Python value, arrays as lists) into `out_dir`."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="gguf-tokenizer-") as tmp:
        _write_metadata(metadata, Path(tmp) / "tokenizer.gguf")
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file="tokenizer.gguf")
    tokenizer.save_pretrained(str(out_dir))


def _write_metadata(metadata: dict[str, Any], path: Path) -> None:
    """A GGUF holding only the architecture and the tokenizer keys, typed as llama.cpp writes them."""
    from gguf import GGUFValueType, GGUFWriter

    arch = str(metadata.get("general.architecture", "llama"))
    if metadata.get("tokenizer.ggml.model") == "gpt2":
        arch = "llama"  # transformers picks its converter by architecture; its llama one reads byte-level BPE as is
    writer = GGUFWriter(str(path), arch=arch)
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            item = GGUFValueType.STRING if value and isinstance(value[0], str) else (
                GGUFValueType.FLOAT32 if value and isinstance(value[0], float) else GGUFValueType.INT32)
            writer.add_array(key, value) if item == GGUFValueType.STRING else writer.add_key_value(
                key, value, GGUFValueType.ARRAY, sub_type=item)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, str(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
