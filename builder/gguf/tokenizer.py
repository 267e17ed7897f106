"""The tokenizer and chat template of a GGUF file, as `tokenizers` and transformers files.

llama.cpp is the reference: the tokenizer built here gives the token ids llama.cpp gives (tokenize with special
tokens parsed, BOS/EOS added as the file says) for every kind accepted below. What llama.cpp does per kind
(src/llama-vocab.cpp):

- `gpt2` (byte-level BPE): the text is split on the control, user-defined and unknown tokens first, then each
  piece through the regexes `tokenizer.ggml.pre` names, one after the other (each match and each stretch between
  matches becomes its own piece), then byte-level BPE with the file's merges by rank. `llama-bpe` first looks a
  whole piece up in the vocabulary (`ignore_merges`).
- `llama` (SentencePiece-style): a space is prepended to each piece of text that starts the input or follows a
  special token (`add_space_prefix`), spaces become U+2581, and adjacent symbols merge highest score first into
  vocabulary tokens; a character with no token falls back to its `<0xXX>` bytes. As a `tokenizers` BPE that is
  merges ranked by the merged token's score, with `byte_fallback`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["GGUFTokenizerError", "SUPPORTED_MODELS", "SUPPORTED_PRE", "tokenizer_from_gguf", "write_tokenizer_files"]

# gguf.TokenType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _Pre:
    """What llama.cpp does for one `tokenizer.ggml.pre` value: its regexes in order, whether a piece that is
    itself a token skips the merges, and whether BOS is added when the file has no `add_bos_token` key."""
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_DEFAULT = _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_PRE = {
    "default": _DEFAULT,
    "gpt-2": _Pre((_GPT2,)),
    "smollm": _Pre((r"\p{N}", _GPT2)),
    "llama-bpe": _Pre((_LLAMA3,), ignore_merges=True, add_bos=True),
    "qwen2": _Pre((_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}"),)),
}
SUPPORTED_MODELS = ("gpt2", "llama")
SUPPORTED_PRE = tuple(_PRE)


class GGUFTokenizerError(ValueError):
    """The GGUF file's tokenizer is one we do not build, or its metadata is incomplete."""


def tokenizer_from_gguf(metadata: dict[str, Any]) -> Tokenizer:
    """The `tokenizers` tokenizer llama.cpp would use for this GGUF metadata (key -> plain Python value).
    `encode(text)` gives llama.cpp's ids with special tokens parsed and BOS/EOS added as the file says."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise GGUFTokenizerError(f"tokenizer.ggml.model {model!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_MODELS)}")
    tokens = _tokens(metadata)
    types = _per_token(metadata, "token_type", len(tokens), NORMAL)
    if model == "gpt2":
        pre = _pre(metadata)
        tok = _bpe(metadata, tokens, pre)
        add_bos = _flag(metadata, "add_bos_token", pre.add_bos)
    else:
        tok = _spm(metadata, tokens, types)
        add_bos = _flag(metadata, "add_bos_token", True)
    _add_special_tokens(tok, tokens, types)
    tok.post_processor = _post_processor(metadata, tokens, add_bos, _flag(metadata, "add_eos_token", False))
    return tok


def write_tokenizer_files(metadata: dict[str, Any], out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and (when the file has one) chat_template.jinja into
    `out_dir`, the files the runtime and transformers read beside a checkpoint."""
    out_dir = Path(out_dir)
    tok = tokenizer_from_gguf(metadata)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(metadata), indent=2) + "\n")
    template = metadata.get("tokenizer.chat_template")
    if template:
        (out_dir / "chat_template.jinja").write_text(template)


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json as transformers writes it for a fast tokenizer: the special tokens' text,
    add_bos/add_eos, and the chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]
    model = metadata.get("tokenizer.ggml.model")
    default_bos = _pre(metadata).add_bos if model == "gpt2" else True
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "add_bos_token": _flag(metadata, "add_bos_token", default_bos),
                              "add_eos_token": _flag(metadata, "add_eos_token", False)}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def _pre(metadata: dict[str, Any]) -> _Pre:
    name = metadata.get("tokenizer.ggml.pre") or "default"  # llama.cpp: missing -> 'default' (with a warning)
    if name not in _PRE:
        raise GGUFTokenizerError(f"tokenizer.ggml.pre {name!r} is not supported; supported: {', '.join(_PRE)}")
    return _PRE[name]


def _flag(metadata: dict[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(f"tokenizer.ggml.{key}")
    return default if value is None else bool(value)


def _tokens(metadata: dict[str, Any]) -> list[str]:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFTokenizerError("the GGUF file has no tokenizer.ggml.tokens; its vocabulary is needed")
    return [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp renames empty tokens so


def _per_token(metadata: dict[str, Any], key: str, n: int, default) -> list:
    values = metadata.get(f"tokenizer.ggml.{key}")
    if values is None:
        return [default] * n
    if len(values) < n:
        raise GGUFTokenizerError(f"tokenizer.ggml.{key} has {len(values)} entries for {n} tokens")
    return list(values)


def _vocab(tokens: list[str]) -> dict[str, int]:
    return {t: i for i, t in enumerate(tokens)}  # a repeated token: the last id wins, as in llama.cpp


def _bpe(metadata: dict[str, Any], tokens: list[str], pre: _Pre) -> Tokenizer:
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise GGUFTokenizerError("tokenizer.ggml.model 'gpt2' needs tokenizer.ggml.merges; the file has none")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(_vocab(tokens), pairs, ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    scores = _per_token(metadata, "scores", len(tokens), 0.0)
    vocab = _vocab(tokens)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab, _score_merges(tokens, scores, types, vocab), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    prefix = _flag(metadata, "add_space_prefix", True)
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _score_merges(tokens: list[str], scores: list[float], types: list[int],
                  vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ranked by the token's score (highest first): llama.cpp merges the
    adjacent pair whose concatenation is the best-scoring token."""
    ranked = []
    for i, token in enumerate(tokens):
        if types[i] == BYTE or vocab.get(token) != i:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control, user-defined and unknown tokens are matched in the raw text before anything else, as llama.cpp
    does when it parses special tokens; user-defined ones are not special (decoding keeps them)."""
    added = [AddedToken(tokens[i], special=t != USER_DEFINED, normalized=False)
             for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED, UNKNOWN)]
    tok.add_tokens(added)


def _post_processor(metadata: dict[str, Any], tokens: list[str], add_bos: bool, add_eos: bool):
    ends = []
    for wanted, key in ((add_bos, "bos_token_id"), (add_eos, "eos_token_id")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if wanted and token_id is None:
            raise GGUFTokenizerError(f"tokenizer.ggml.{key.replace('_token_id', '')} is added to every prompt but "
                                     f"the file has no tokenizer.ggml.{key}")
        if wanted and not 0 <= token_id < len(tokens):
            raise GGUFTokenizerError(f"tokenizer.ggml.{key} {token_id} is not a token id (the vocabulary has "
                                     f"{len(tokens)})")
        ends.append((tokens[token_id], token_id) if wanted else None)
    bos, eos = ends
    if not bos and not eos:
        return None
    single = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else []))
    pair = single + " " + " ".join(([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else []))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[e for e in ends if e])
