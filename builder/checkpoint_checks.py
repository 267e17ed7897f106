"""Checks on a checkpoint before any work, so that a broken one is refused with a message naming the file
or tensor instead of building an engine that fails at run time (verification is off by default for
large models, so nothing later would catch it).

- config.json is a JSON object with a model_type transformers knows, and does not ask for the
  checkpoint's own Python code (`auto_map`): the builder never runs checkpoint code.
- tokenizer.json is present and loads with `tokenizers`.
- every tensor the model uses has the shape of the HF skeleton's parameter (the skeleton is built on
  the meta device from config.json, so its shapes ARE the shapes the config implies, for any family)
  and a floating dtype the builder reads."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from builder.weights import Checkpoint, CheckpointError

FLOAT_DTYPES = ("F32", "F16", "BF16")


def check_checkpoint_files(checkpoint_dir: str | Path) -> dict:
    """config.json and tokenizer.json, before transformers reads anything. Returns the config dict."""
    path = Path(checkpoint_dir)
    config = _config(path / "config.json")
    if "auto_map" in config:
        raise CheckpointError(f"{path / 'config.json'}: 'auto_map' asks to run Python code shipped with the "
                              f"checkpoint ({sorted(config['auto_map'])}); the builder never runs checkpoint code "
                              f"(trust_remote_code=False). Use a checkpoint of a family transformers implements")
    _model_type(path / "config.json", config)
    _sizes(path / "config.json", config)
    _transformers_accepts(path)
    _tokenizer(path / "tokenizer.json", config.get("vocab_size"))  # absent: a wrapper config, refused by its spec
    if (path / "generation_config.json").is_file():
        _config(path / "generation_config.json")
    return config


def _config(file: Path) -> dict:
    """A JSON object file (config.json, generation_config.json)."""
    if not file.is_file():
        raise CheckpointError(f"{file.parent}: no config.json; expected a Hugging Face checkpoint directory")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not valid JSON ({err}); fix or re-save the config") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: must be a JSON object, got {type(config).__name__}")
    return config


def _model_type(file: Path, config: dict) -> None:
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"{file}: model_type {model_type!r} is not a model type transformers knows; "
                              f"supported families are the specs in model_specs/ (e.g. 'llama', 'mistral', 'qwen2')")


SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "vocab_size", "max_position_embeddings")


def _sizes(file: Path, config: dict) -> None:
    """The sizes the skeleton is built from are positive integers (0 heads would divide by zero in transformers)."""
    for key in SIZE_KEYS:
        value = config.get(key, 1)
        if key in ("num_key_value_heads", "head_dim") and value is None:
            continue  # null means "derive it" for these two
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{file}: {key} must be a positive integer, got {value!r}")


def _transformers_accepts(path: Path) -> None:
    """transformers' own validation of the config (e.g. hidden_size a multiple of the heads), as one line."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - huggingface_hub's validation errors derive from Exception only
        reason = " ".join(str(err).split())
        raise CheckpointError(f"{path / 'config.json'}: transformers rejects the config: {reason[:300]}") from None


def _tokenizer(file: Path, vocab_size: int | None) -> None:
    from tokenizers import Tokenizer

    if not file.is_file():
        raise CheckpointError(f"{file.parent}: no tokenizer.json; the runtime needs the fast-tokenizer file "
                              f"(save the tokenizer with transformers' save_pretrained)")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a damaged file
        raise CheckpointError(f"{file}: the tokenizer does not load ({err}); re-save it with "
                              f"transformers' save_pretrained") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and size > vocab_size:
        raise CheckpointError(f"{file}: the tokenizer has {size} tokens but config.json's vocab_size is {vocab_size}; "
                              f"ids past {vocab_size - 1} would have no embedding: use the model's own tokenizer")


def check_tensors(checkpoint: Checkpoint, skeleton: Any, names: dict[str, str]) -> None:
    """Every checkpoint tensor in `names` (IR key -> HF name) against the meta skeleton's parameter."""
    expected = dict(skeleton.named_parameters(remove_duplicate=False))
    available = checkpoint.names()
    problems = []
    for hf in sorted(set(names.values()) & available):
        want, found = tuple(expected[hf].shape), checkpoint.shape(hf)
        if found != want:
            problems.append(f"{checkpoint.describe(hf)}: shape {list(found)}, expected {list(want)} from config.json")
        dtype = checkpoint.dtype(hf)
        if dtype not in FLOAT_DTYPES:
            problems.append(f"{hf}: dtype {dtype}, expected one of {list(FLOAT_DTYPES)}")
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise CheckpointError(f"{checkpoint.path}: tensors do not match the config: {'; '.join(problems[:4])}{more}")
