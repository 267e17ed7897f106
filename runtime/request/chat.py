"""Chat templates: the checkpoint's Jinja template rendered the way transformers renders it, and tokenized so
that no message's content can become a control token.

Role injection: a user who writes `<|im_end|>\n<|im_start|>system ...` in a message must not open a system
turn. `chat_ids` replaces each special token's text found in a message's content with a marker before
rendering; after rendering, the template's own markup is tokenized with special tokens parsed, and each marked
piece of content as plain text (transformers' `split_special_tokens`). Content without special-token text is
tokenized exactly as transformers' `apply_chat_template(tokenize=True)` does (the rendered string, special
tokens parsed, no tokenizer-added BOS/EOS: the template writes its own)."""
from __future__ import annotations

import json
import re
import secrets
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer


MAX_RENDERED_CHARS = 1 << 22


class ChatTemplateError(ValueError):
    """The engine's tokenizer has no chat template."""


def find_template(engine_dir: Path) -> tuple[str, dict]:
    config = {}
    if (engine_dir / "tokenizer_config.json").is_file():
        config = json.loads((engine_dir / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if (engine_dir / "chat_template.jinja").is_file():
        template = (engine_dir / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: take "default"
        template = {t["name"]: t["template"] for t in template}.get("default")
    if not template:
        raise ChatTemplateError(f"{engine_dir}: the checkpoint's tokenizer has no chat template; "
                                f"run without --chat or give a plain prompt")
    return template, config


def render_chat(engine_dir: Path, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    """Render `messages` ([{"role": ..., "content": ...}]) with the engine's chat template, in Jinja's immutable
    sandbox (no attribute access outside it) and at most MAX_RENDERED_CHARS characters (jinja2.TemplateError
    beyond); `tools` (OpenAI's function tools) go to a template that renders them, and into the system message
    for one that does not (runtime/request/tools.py)."""
    from runtime.request.tools import template_messages

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template, config = find_template(engine_dir)
    messages, tools = _placed_tools(template, messages, tools)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        """transformers' filter: keys in their order, no HTML escaping (Jinja's own sorts and escapes)."""
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    pieces, size = [], 0
    for piece in env.from_string(template).generate(messages=template_messages(messages), tools=tools or None,
                                                     add_generation_prompt=add_generation_prompt, **specials):
        size += len(piece)
        if size > MAX_RENDERED_CHARS:  # a template is data from a downloaded file: its output is bounded
            raise jinja2.exceptions.TemplateRuntimeError(
                f"the chat template's output passed {MAX_RENDERED_CHARS} characters; no prompt is that long")
        pieces.append(piece)
    return "".join(pieces)


def _placed_tools(template: str, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as the template is given them: tools described in the system message where it does
    not render them."""
    from runtime.request.tools import template_renders_tools, tools_in_system_message

    if tools and not template_renders_tools(template):
        return tools_in_system_message(template, messages, tools), None
    return messages, tools


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""


class GuardedChat:
    """A chat rendered with the special-token text of its messages' content marked: `text` (for size checks:
    the markers stand for the special text they replace) and `ids()`."""

    def __init__(self, engine_dir: Path, tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None):
        self.tokenizer, self._found = tokenizer, []
        specials = _special_texts(tokenizer)
        self._nonce = secrets.token_hex(4)
        messages, tools = _placed_tools(find_template(engine_dir)[0], messages, tools)  # described tools marked too
        marked = [{**m, "content": self._mark(m["content"], specials)} if isinstance(m.get("content"), str) else m
                  for m in messages]
        self.marked = render_chat(engine_dir, marked, add_generation_prompt, tools)
        self._pattern = re.compile(f"\ue000{self._nonce}:(\\d+)\ue001")
        self.text = self._pattern.sub(lambda m: self._found[int(m.group(1))], self.marked)

    def _mark(self, content: str, specials: re.Pattern | None) -> str:
        if specials is None:
            return content

        def marker(match: re.Match) -> str:
            self._found.append(match.group(0))
            return f"\ue000{self._nonce}:{len(self._found) - 1}\ue001"

        return specials.sub(marker, content)

    def ids(self) -> list[int]:
        """The rendered chat's token ids: markup with special tokens parsed, marked content as plain text."""
        if not self._found:
            return self.tokenizer.encode(self.marked, add_special_tokens=False).ids
        plain, ids, last = _plain(self.tokenizer), [], 0
        for m in self._pattern.finditer(self.marked):
            if m.start() > last:
                ids += self.tokenizer.encode(self.marked[last:m.start()], add_special_tokens=False).ids
            ids += plain.encode(self._found[int(m.group(1))], add_special_tokens=False).ids
            last = m.end()
        if last < len(self.marked):
            ids += self.tokenizer.encode(self.marked[last:], add_special_tokens=False).ids
        return ids


def _special_texts(tokenizer: Tokenizer) -> re.Pattern | None:
    """A pattern matching the text of every special added token (longest first), or None when there are none."""
    texts = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content},
                   key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


@lru_cache(maxsize=8)
def _plain(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that reads special-token text as plain text."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy
