"""Text for calibration, distillation and evaluation: files (or folders of .py/.txt/.md files) tokenized with the
teacher's tokenizer into fixed, non-overlapping windows, so a step's batch is a function of its step number."""
from __future__ import annotations

from pathlib import Path

import torch

from builder.compress.plan import CompressError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl")


def text_files(paths: list[str | Path]) -> list[Path]:
    """The files named, and the text files under the folders named, sorted within each folder."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise CompressError(f"{path}: no such file or folder; give text files or folders of "
                                f"{'/'.join(TEXT_SUFFIXES)} files")
    return files


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """The texts encoded and concatenated, each preceded by the end-of-text token: [tokens] int64."""
    ids: list[int] = []
    for text in texts:
        ids.append(tokenizer.eos_token_id)
        ids += tokenizer(text, add_special_tokens=False).input_ids
    return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and next-token targets): [n, seq_len + 1]."""
    count = (stream.numel() - 1) // seq_len
    if limit is not None:
        count = min(count, limit)
    if count < 1:
        raise CompressError(f"the text has {stream.numel()} tokens, fewer than one window of {seq_len + 1}; "
                            f"give more text or a smaller --seq-len")
    return torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(count)])


def load_windows(tokenizer, paths: list[str | Path], seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Windows [n, seq_len + 1] of the text in `paths` (files or folders)."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in text_files(paths)]
    if not texts:
        raise CompressError(f"no text files in {', '.join(map(str, paths))}")
    return windows(token_stream(tokenizer, texts), seq_len, limit)


def batches(rows: torch.Tensor, batch_size: int):
    """Consecutive batches of rows (the last one may be short)."""
    for first in range(0, rows.shape[0], batch_size):
        yield rows[first: first + batch_size]


def chat_markup(tokenizer) -> tuple[list[int], int, set[int]] | None:
    """The chat template's markup as token ids: (the assistant header, the token that opens a turn, the ids that end a
    reply), rendered from the template itself; None when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    turn = [{"role": "user", "content": "x"}]
    plain = list(tokenizer.apply_chat_template(turn, tokenize=True, return_dict=True)["input_ids"])
    prompted = list(tokenizer.apply_chat_template(turn, tokenize=True, return_dict=True,
                                                  add_generation_prompt=True)["input_ids"])
    if prompted[:len(plain)] != plain or len(prompted) == len(plain):
        return None
    eos = tokenizer.eos_token_id
    return prompted[len(plain):], plain[0], set(eos if isinstance(eos, list) else [eos])


def reply_mask(stream: torch.Tensor, header: list[int], turn_start: int, ends: set[int], blank) -> torch.Tensor:
    """Which tokens of `stream` [n] belong to assistant replies [n] bool: those after each `header`, through the first
    of `ends` (included) or up to the next `turn_start` (a reply cut short, less the blank tokens written after it:
    `blank(id)` says whether a token is whitespace only). Tokens before the first header are not a reply (a window cut
    mid-reply starts there)."""
    ids, mask = stream.tolist(), torch.zeros(stream.numel(), dtype=torch.bool)
    k, start = len(header), None
    for i in range(len(ids)):
        if start is None:
            if i >= k and ids[i - k:i] == header:
                start = i
        if start is None:
            continue
        if ids[i] == turn_start:
            end = i
            while end > start and blank(ids[end - 1]):
                end -= 1
            mask[start:end], start = True, None
        elif ids[i] in ends:
            mask[start:i + 1], start = True, None
    if start is not None:
        mask[start:] = True
    return mask


def window_replies(rows: torch.Tensor, tokenizer) -> torch.Tensor | None:
    """reply_mask over consecutive windows `rows` [n, seq + 1] (`windows` cuts them from one stream, each sharing its
    first token with the one before's last), cut the same way: [n, seq + 1] bool; None without a chat template or
    without a reply in the text."""
    markup = chat_markup(tokenizer)
    if markup is None:
        return None
    stream = torch.cat([rows[0], rows[1:, 1:].reshape(-1)])
    mask = reply_mask(stream, *markup, lambda token: not tokenizer.decode([token]).strip())
    return windows(mask, rows.shape[1] - 1) if mask.any() else None  # no conversations: none to score apart
