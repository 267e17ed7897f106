"""Streaming detokenization and stop strings.

IncrementalDetokenizer turns token ids into text deltas with the prefix-offset / read-offset technique
(TGI, vLLM): decode a short window of already-emitted tokens, decode the window plus the new tokens,
and emit the difference once it does not end in U+FFFD (an incomplete UTF-8 character). Decoding a
window instead of single tokens keeps decoders that strip or merge spaces (Metaspace, WordPiece)
correct. StopChecker / TextStream add stop strings on top.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"
_PROMPT_WINDOW = 5  # prompt tokens decoded as left context when prompt_context=True


class IncrementalDetokenizer:
    """Token-by-token text deltas whose concatenation equals decoding all generated ids at once.

    add(token_id) returns the newly finalized text (possibly ""), flush() whatever is still held back.
    By default the concatenation of deltas equals
    `tokenizer.decode(generated_ids, skip_special_tokens=skip_special_tokens)`; `prompt_ids` are then
    ignored. With `prompt_context=True` the last prompt tokens serve as left context instead (vLLM
    style), so the deltas continue the prompt's text: a leading space that a Metaspace decoder would
    strip from the first generated word is kept.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True, *, prompt_context: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        use_ctx = prompt_context and prompt_ids is not None and len(prompt_ids) > 0
        ctx = [int(t) for t in prompt_ids[-_PROMPT_WINDOW:]] if use_ctx else []
        self._ids: list[int] = ctx          # context ids followed by generated ids
        self._n_context = len(ctx)
        self._prefix = 0                    # start of the decode window
        self._read = len(ctx)               # end of the already-emitted part
        self._prefix_text = self._decode(self._prefix, self._read)

    @property
    def generated_ids(self) -> list[int]:
        """The ids passed to add() so far."""
        return self._ids[self._n_context:]

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._ids[start:end]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _emit(self, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        new_text = self._decode(self._prefix)
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith(_REPLACEMENT) and not force):
            return ""
        delta = new_text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        return delta

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it finalizes (held back while a char is incomplete)."""
        self._ids.append(int(token_id))
        return self._emit(force=False)

    def flush(self, drop_incomplete: bool = False) -> str:
        """Return the text still held back: an incomplete trailing char decodes to U+FFFD, as decode() does, or
        with `drop_incomplete` is left out (generation cut short mid-character: the bytes never became one)."""
        delta = self._emit(force=True)
        return delta.rstrip(_REPLACEMENT) if drop_incomplete else delta


class StopChecker:
    """Finds stop strings in generated text and tells how much of it is safe to stream."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop: tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        self.max_len = max((len(s) for s in self.stop), default=0)

    def find(self, text: str, start: int = 0) -> tuple[int, str | None]:
        """(index, stop string) of the earliest stop string occurring at or after `start`, or (-1, None)."""
        best, which = -1, None
        for s in self.stop:
            i = text.find(s, start)
            if i >= 0 and (best < 0 or i < best):
                best, which = i, s
        return best, which

    def check(self, text: str) -> tuple[bool, str]:
        """(hit, text truncated before the first stop string; the whole text when no hit)."""
        i, _ = self.find(text)
        return (True, text[:i]) if i >= 0 else (False, text)

    def safe_length(self, text: str) -> int:
        """Chars of `text` that can be streamed now: all but the longest suffix that begins a stop string."""
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return len(text) - hold


class TextStream:
    """Detokenizer + stop strings: push() ids, get deltas; the deltas concatenate to the decoded
    generated text up to (not including) the first stop string, or to all of it after finish()."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True, *, prompt_context: bool = False) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens,
                                                  prompt_context=prompt_context)
        self.stops = StopChecker(stop)
        self._text = ""          # all finalized text so far
        self._emitted = 0        # chars of _text already returned
        self.stopped = False     # a stop string was hit
        self.stop_string: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[:self._emitted]

    def _advance(self, new: str, final: bool) -> str:
        if not self.stops.stop:  # nothing to hold back: the finalized text streams at once
            self._text += new
            self._emitted = len(self._text)
            return new
        start = max(0, len(self._text) - self.stops.max_len + 1)
        self._text += new
        pos, which = self.stops.find(self._text, start)
        if pos >= 0:
            pos = max(pos, self._emitted)
            delta, self._emitted = self._text[self._emitted:pos], pos
            self.stopped, self.stop_string, self.finished = True, which, True
            return delta
        end = len(self._text) if final else max(self._emitted, self.stops.safe_length(self._text))
        delta, self._emitted = self._text[self._emitted:end], end
        return delta

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one generated id. Returns (text safe to show now, stopped). After a stop, returns ("", True)."""
        if self.finished:
            return "", self.stopped
        delta = self._advance(self.detokenizer.add(token_id), final=False)
        return delta, self.stopped

    def finish(self, drop_incomplete: bool = False) -> str:
        """End of generation: return everything held back (partial stop-string matches, incomplete chars as
        U+FFFD, or left out with `drop_incomplete`: a length stop inside a multi-byte character)."""
        if self.finished:
            return ""
        delta = self._advance(self.detokenizer.flush(drop_incomplete), final=True)
        self.finished = True
        return delta
