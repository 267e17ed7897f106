"""Request validation for the Python API and engine-run: what a prompt and its params may be, checked
before any tokenizing or work, each refusal a RequestError naming the argument and what is allowed.

Prompt size bound: a prompt of more than `max_seq_len * BYTES_PER_TOKEN_FACTOR * L` UTF-8 bytes, where L
is the vocabulary's longest token in bytes, cannot fit in `max_seq_len` tokens (each token covers at most
L bytes of text; the factor 4 leaves room for normalizers that shrink text, such as accent stripping),
so it is rejected by its length alone, before the tokenizer spends time and memory on it."""
from __future__ import annotations

import numbers
from typing import Any, Sequence

from runtime.request.params import SamplingParams

BYTES_PER_TOKEN_FACTOR = 4
TOO_LONG = "context_length_exceeded"  # RequestError.code of a request that does not fit the context (OpenAI's code)


class RequestError(ValueError):
    """A request cannot be served by this engine as loaded (too long, empty, bad parameters). `field` is the
    argument at fault in the Python API's terms (`prompt`, `params`, a SamplingParams field such as
    `max_new_tokens`): engine-run and engine-serve render it as their flag or JSON field."""

    def __init__(self, message: str, field: str = "prompt", code: str | None = None):
        super().__init__(message)
        self.field, self.code = field, code  # code: "context_length_exceeded" when the request is too long


def longest_token_bytes(tokenizer) -> int:
    """UTF-8 length of the longest vocabulary entry (an upper bound on the text bytes one token covers
    for byte-level BPE and SentencePiece vocabularies, whose entries spell their bytes out)."""
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=1)


def prompt_byte_limit(tokenizer, max_seq_len: int) -> int:
    return max_seq_len * BYTES_PER_TOKEN_FACTOR * max(1, longest_token_bytes(tokenizer))


def check_text(prompt: str, byte_limit: int) -> None:
    """A text prompt: valid Unicode (no lone surrogates) and within the byte bound."""
    if len(prompt) > byte_limit:  # every character is at least one byte: no need to encode a huge string
        raise RequestError(f"the prompt has {len(prompt)} characters, more than this engine can take: at most "
                           f"{byte_limit} UTF-8 bytes (max_seq_len x {BYTES_PER_TOKEN_FACTOR} x the longest token)",
                           code=TOO_LONG)
    try:
        size = len(prompt.encode("utf-8"))
    except UnicodeEncodeError as err:
        raise RequestError(f"the prompt is not valid Unicode text ({err.reason} at character {err.start}); "
                           f"give UTF-8 text") from None
    if size > byte_limit:
        raise RequestError(f"the prompt is {size} UTF-8 bytes; this engine takes at most {byte_limit} "
                           f"(max_seq_len x {BYTES_PER_TOKEN_FACTOR} x the longest token)", code=TOO_LONG)


def check_ids(prompt: Sequence[Any], vocab: int) -> list[int]:
    """Token ids: integers (numpy integers too) in 0..vocab-1; floats and bools are refused, not truncated."""
    ids = list(prompt)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise RequestError(f"token id {t!r} ({type(t).__name__}) is not an integer; a prompt is a str or "
                               f"a sequence of int token ids")
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab]
    if bad:
        raise RequestError(f"token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
    return [int(t) for t in ids]


def check_prompt_type(prompt: Any) -> None:
    """A str, or a sequence / numpy array of token ids (their values are checked by check_ids)."""
    ids = isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)) or hasattr(prompt, "__array__")
    if not isinstance(prompt, str) and not ids:
        raise RequestError(f"a prompt is a str or a sequence of int token ids, got {type(prompt).__name__}")


def check_prompts(prompts: Any) -> None:
    """generate() takes a list of prompts; a bare str would otherwise be read as one prompt per character."""
    if isinstance(prompts, (str, bytes)) or prompts is None or not isinstance(prompts, Sequence):
        raise RequestError(f"generate() takes a list of prompts, got {type(prompts).__name__}; "
                           f"for one prompt pass [prompt] or use submit()/stream()")


def check_params(params: Any) -> SamplingParams:
    """None (the defaults) or a SamplingParams; a dict is refused with how to make one."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        hint = "; build one with SamplingParams(**your_dict)" if isinstance(params, dict) else ""
        raise RequestError(field="params", message=f"params must be a SamplingParams (or None for the defaults), got "
                           f"{type(params).__name__}{hint}")
    return params
