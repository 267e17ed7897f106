"""Tool calls in the Hermes style that Qwen-family chat templates use: the template renders `tools` into the
prompt, the model answers `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, parsed here into OpenAI's
`tool_calls`; messages that carry calls back (assistant `tool_calls` with JSON-text arguments) are given to the
template with their arguments as objects, as vLLM and transformers' templates expect."""
from __future__ import annotations

import json
import re
import secrets

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_renders_tools(template: str) -> bool:
    """Whether a chat template reads `tools` at all (a template that does not would drop them silently)."""
    return re.search(r"\btools\b", template) is not None


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's tool call arguments (JSON text on the wire) as objects."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                                     for c in calls]}
        out.append(m)
    return out


def _arguments(function: dict):
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def call(name: str, arguments: str) -> dict:
    """One OpenAI tool call object (arguments: JSON text)."""
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, tool calls) of a Hermes-style answer; a block that is not a JSON object
    with a string "name" stays in the content."""
    calls, kept, last = [], [], 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(call(obj["name"], json.dumps(obj.get("arguments", {}))))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls
