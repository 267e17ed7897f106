"""Chat templates: the checkpoint's Jinja template rendered the way transformers renders it."""
from __future__ import annotations

import json
from pathlib import Path


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


def render_chat(engine_dir: Path, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Render `messages` ([{"role": ..., "content": ...}]) with the engine's chat template, in Jinja's immutable
    sandbox (no attribute access outside it) and at most MAX_RENDERED_CHARS characters (jinja2.TemplateError
    beyond)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template, config = find_template(engine_dir)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    pieces, size = [], 0
    for piece in env.from_string(template).generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     **specials):
        size += len(piece)
        if size > MAX_RENDERED_CHARS:  # a template is data from a downloaded file: its output is bounded
            raise jinja2.exceptions.TemplateRuntimeError(
                f"the chat template's output passed {MAX_RENDERED_CHARS} characters; no prompt is that long")
        pieces.append(piece)
    return "".join(pieces)


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
