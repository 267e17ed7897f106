"""Tool calls in the Hermes style that Qwen-family chat templates use: the template renders `tools` into the
prompt, the model answers `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, parsed here into OpenAI's
`tool_calls`; messages that carry calls back (assistant `tool_calls` with JSON-text arguments) are given to the
template with their arguments as objects, as vLLM and transformers' templates expect. A template that does not
render tools (SmolLM2's) gets them described in the system message instead, in the same Hermes form
(`tools_in_system_message`): transformers and vLLM would drop them silently there, TGI and llama.cpp's server
describe them in the prompt as this does."""
from __future__ import annotations

import json
import re
import secrets

from runtime.request.structured import JSON_LAYOUT

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_renders_tools(template: str) -> bool:
    """Whether a chat template reads `tools` at all (a template that does not would drop them silently)."""
    return re.search(r"\btools\b", template) is not None


TOOLS_PROMPT = ("You may call functions to answer. Their signatures, one JSON object a line, are within "
                "<tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call one, answer with a JSON object of "
                "the function's name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
                '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def tools_in_system_message(template: str, messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` for a template that does not read `tools`: the definitions described after the system message's
    text (a new system message first when there is none) in the Hermes form that `parse_hermes` reads back; where the
    template does not read `tool_calls` either, an assistant's calls become its Hermes text, and a `tool`
    message's content is wrapped in <tool_response> tags."""
    described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
    head, rest = (messages[0], messages[1:]) if messages and messages[0].get("role") == "system" else (None, messages)
    system = {"role": "system", "content": described if head is None else f"{head['content']}\n\n{described}"}
    if "tool_calls" not in template:
        rest = [_as_text(m) for m in rest]
    return [{**(head or {}), **system}, *rest]


def _as_text(message: dict) -> dict:
    if message.get("role") == "tool":
        return {**message, "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = "\n".join(f'<tool_call>\n{json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"])}, ensure_ascii=False)}\n</tool_call>'
                     for c in calls)
    content = f"{message['content']}\n{text}" if message.get("content") else text
    return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": content}


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


def required_grammar(tools: list[dict]) -> str:
    """A Lark grammar (llguidance's dialect) for tool_choice "required": one or more Hermes calls, each a JSON
    object {"name": one of the tools, "arguments": valid against that tool's parameters}, as vLLM constrains it."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    schema = {"anyOf": calls, "x-guidance": JSON_LAYOUT}
    return 'start: call ("\\n" call)*\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json ' + json.dumps(schema)


class ToolCallStream:
    """One streamed chat choice with tools, as OpenAI streams it: deltas {"content": ...} and {"tool_calls": [...]}.
    With a named function (`named`) the whole output is its arguments, streamed as they come after a first delta
    with the call's id and name. Otherwise text goes out as content until a `<tool_call>` starts (or may be
    starting: a piece of it, or whitespace, at the end is held); from there on it is held and parsed when the
    answer ends: each call one delta with its whole arguments, text that is not a call content."""

    OPEN = "<tool_call>"

    def __init__(self, named: str | None = None):
        self.named, self.held, self.calling, self.calls = named, "", False, []

    def feed(self, text: str) -> list[dict]:
        """The deltas for the next piece of text."""
        if self.named is not None:
            if not self.calls:
                self.calls.append(call(self.named, ""))
                return [{"tool_calls": [{"index": 0, **self.calls[0], "function": {"name": self.named, "arguments": text}}]}]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
        self.held += text
        if self.calling:
            return []
        start = self.held.find(self.OPEN)
        if start >= 0:
            self.calling = True
            out, self.held = self.held[:start].rstrip(), self.held[start:]
        else:
            out = self.held.rstrip()
            out = next((out[:len(out) - k] for k in range(min(len(self.OPEN) - 1, len(out)), 0, -1)
                        if self.OPEN.startswith(out[len(out) - k:])), out).rstrip()  # a piece of <tool_call> at the end
            self.held = self.held[len(out):]
        return [{"content": out}] if out else []

    def end(self) -> list[dict]:
        """The deltas still owed when the answer ends: the held text as calls and content."""
        if self.named is not None:
            return []
        content, self.calls = parse_hermes(self.held) if self.calling else (self.held, [])
        out = [{"content": content}] if content else []
        return out + [{"tool_calls": [{"index": j, **c}]} for j, c in enumerate(self.calls)]
