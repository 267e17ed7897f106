"""Log-probabilities in OpenAI's response shapes (runtime/request/logprobs.py computes them).

Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, one entry per token (with echo the
prompt's tokens first: the first has no logprob, null). Chat: {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}]}. A token's string is its own decoded text (a piece of a
multi-byte character decodes to U+FFFD there, as in other servers); `bytes` are its exact bytes."""
from __future__ import annotations

import dataclasses
import re
from functools import lru_cache

from tokenizers import Tokenizer

from runtime.request import tools
from runtime.request.logprobs import TokenLogprob

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, to the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class LogprobFormat:
    """Token strings, bytes and the OpenAI objects for one engine's tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._byte_level = "ByteLevel" in str(tokenizer.decoder)
        self._text: dict[int, str] = {}

    def text(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self._text[token]

    def bytes(self, token: int) -> list[int]:
        """The token's exact bytes (byte-level BPE and byte-fallback pieces spell them out)."""
        piece = self.tokenizer.id_to_token(token) or ""
        if self._byte_level and all(c in _byte_level() for c in piece):
            return [_byte_level()[c] for c in piece]
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return [int(m.group(1), 16)]
        return list(self.text(token).encode("utf-8"))

    def completion(self, ids: list[int], entries: list[TokenLogprob | None], offset: int = 0) -> dict:
        """The completions object for tokens `ids` (their entries; None: not scored), text offsets from `offset`."""
        tokens = [self.text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else {self.text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def chat(self, entries: list[TokenLogprob]) -> dict:
        return {"content": [{**self._entry(e.token, e.logprob),
                             "top_logprobs": [self._entry(t, lp) for t, lp in e.top]} for e in entries]}

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": self.bytes(token)}


class Answer:
    """What a request's choices say besides their text: the echoed prompt (completions' `echo`), the logprobs
    objects, and `max_tokens: 0` (the prompt scored, nothing generated: a one-token generation whose token is
    dropped). `seqs`: each choice's Sequence, in index order (n choices per prompt)."""

    def __init__(self, req, chat: bool, tokenizer: Tokenizer, seqs: list):
        self.chat, self.seqs, self.fmt = chat, seqs, LogprobFormat(tokenizer)
        self.scored = req.scoring()[0] is not None
        self.echo = not chat and req.echo
        self.score_only = not chat and req.max_tokens == 0
        prompts = [] if chat else req.prompts()
        self._prompt_text = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
        self._n = req.n
        self._sent = [0] * len(seqs)  # generated tokens streamed so far, per choice
        # the next streamed token's text offset, per choice (after the prompt's text: echoed, its tokens' text)
        self._offset = [0 if self.echo else len(self.prompt_text(k)) for k in range(len(seqs))]
        self._echoed: set[int] = set()
        self.tools, self.tool_choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
        self.named_tool = req.named_tool() if chat else None
        calls_tools = bool(self.tools) and self.tool_choice != "none"
        name = None if self.named_tool is None else self.named_tool.name
        # a streamed chat with tools: each choice's text parsed for calls as it comes (runtime/request/tools.py)
        self.tool_streams = [tools.ToolCallStream(name) for _ in seqs] if calls_tools and req.stream else None

    def prompt_text(self, k: int) -> str:
        return self._prompt_text[k // self._n] if self._prompt_text else ""

    def trimmed(self, c):
        """The completion as answered: with max_tokens 0, nothing generated."""
        if not self.score_only:
            return c
        return dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                                   finish_reason="length")

    def choice(self, k: int, c) -> tuple[str | None, str, dict | None, list | None]:
        """(text, finish_reason, logprobs object, tool calls) of choice k's whole answer."""
        text = self.prompt_text(k) + c.text if self.echo else c.text
        if self.chat:
            text, reason, calls = self._tool_calls(text, c.finish_reason)
            return text, reason, self.fmt.chat(c.logprobs) if self.scored else None, calls
        if not self.scored:
            return text, c.finish_reason, None, None
        prompt = self.seqs[k].prompt_ids if self.echo else []
        entries = (list(c.prompt_logprobs) if self.echo else []) + c.logprobs
        offset = 0 if self.echo else len(self.prompt_text(k))
        return text, c.finish_reason, self.fmt.completion(prompt + c.token_ids, entries, offset), None

    def _tool_calls(self, text: str, reason: str) -> tuple[str | None, str, list | None]:
        """A chat answer with tools: the named function's arguments (tool_choice), or the Hermes calls it made."""
        if self.named_tool is not None and reason == "stop":
            return None, "tool_calls", [tools.call(self.named_tool.name, text)]
        if self.tools and self.named_tool is None and self.tool_choice != "none":
            content, calls = tools.parse_hermes(text)
            if calls:
                return content, "tool_calls", calls
        return text, reason, None

    def stream_chunks(self, shape, k: int, text: str | None, tokens: int) -> list[dict]:
        """Choice k's chunks for `tokens` outputs streamed with `text` (None: it ended): the echoed prompt first,
        then the text with its tokens' logprobs."""
        chunks = []
        if self.echo and k not in self._echoed:
            self._echoed.add(k)
            seq, obj = self.seqs[k], None
            if self.scored:
                obj = self.fmt.completion(seq.prompt_ids, list(seq.scores.prompt), 0)
                self._offset[k] = sum(len(t) for t in obj["tokens"])
            chunks.append(shape.chunk(k, self.prompt_text(k), logprobs=obj))
        if text is None or not (text or tokens):
            return chunks
        obj = None
        if self.scored:
            entries = self.seqs[k].scores.generated[self._sent[k]:self._sent[k] + tokens]
            self._sent[k] += tokens
            if self.chat:
                obj = self.fmt.chat(entries)
            else:
                obj = self.fmt.completion([e.token for e in entries], entries, self._offset[k])
                self._offset[k] += sum(len(t) for t in obj["tokens"])
        chunks.append(shape.chunk(k, text, logprobs=obj))
        return chunks

    def tool_chunks(self, shape, k: int, text: str | None) -> list[dict]:
        """Choice k's chunks for streamed `text` of a chat with tools (None: it ended, the calls held go out)."""
        stream = self.tool_streams[k]
        deltas = stream.end() if text is None else stream.feed(text)
        return [shape.chunk(k, None, delta=d) for d in deltas]

    def stream_reason(self, k: int, reason: str) -> str:
        """Choice k's finish reason as streamed: "tool_calls" when it made calls (a named function: when it ended
        its arguments), as `choice` answers whole."""
        if self.tool_streams is None or not self.tool_streams[k].calls:
            return reason
        return "tool_calls" if self.named_tool is None or reason == "stop" else reason
