"""The OpenAI wire format engine-serve speaks: request bodies (pydantic, unknown fields ignored),
their mapping to SamplingParams, response objects, stream chunks and error bodies."""
from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import from_json

from runtime.request.tools import required_grammar
from runtime.request.params import MAX_LOGPROBS, SamplingParams
from runtime.request.structured import StructuredOutput


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}};
    `headers` go with it (a 429's Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


# OpenAI fields this server does not implement: the values that mean "off", and what to send instead
REFUSED = {"logit_bias": ((None, {}), "leave it out or give {}"),
           "best_of": ((None, 1), "leave it out or give 1 (use n for several choices)"),
           "suffix": ((None,), "leave it out")}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict = Field(alias="schema")  # "schema" shadows a BaseModel attribute
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    """Fields both endpoints share. OpenAI's defaults: temperature 1, top_p 1, n 1. Numbers must be
    finite (a NaN or Infinity literal is a 400 naming its field)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # extensions vLLM users know
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    speculation: Literal["ngram", "draft", "eagle", "none"] | None = None
    # structured outputs: OpenAI's response_format, and vLLM's extension fields
    response_format: ResponseFormat | None = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of at most 4 non-empty strings")
        return stops

    def unsupported(self) -> None:
        """Known OpenAI fields this engine cannot honour: a 400 naming the field."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0.0:
                raise APIError(400, f"{name} is not supported by this server (use repetition_penalty); "
                                    f"give 0 or leave it out", name)
        for name, (allowed, hint) in REFUSED.items():
            if getattr(self, name, None) not in allowed:
                raise APIError(400, f"{name} is not supported by this server; {hint}", name)
        field, constraint = self.structured()
        if constraint is not None and self.ignore_eos:
            raise APIError(400, f"ignore_eos cannot be combined with {field}: a structured output ends where it "
                                f"matches", "ignore_eos")

    def scoring(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for SamplingParams: alternatives per generated / prompt token, None: not scored."""
        return None, None

    def structured(self) -> tuple[str | None, StructuredOutput | None]:
        """(the field that asks, the constraint) of the request's structured output, (None, None) for free text;
        asking in two fields is a 400."""
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", StructuredOutput.json_object()))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                    "{...}}}", "response_format")
            asked.append(("response_format", StructuredOutput.json(fmt.json_schema.json_schema)))
        if self.guided_json is not None:
            asked.append(("guided_json", StructuredOutput.json(self.guided_json)))
        if self.guided_regex is not None:
            asked.append(("guided_regex", StructuredOutput.regex(self.guided_regex)))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", StructuredOutput.grammar(self.guided_grammar)))
        if len(asked) > 1:
            raise APIError(400, f"ask for one structured output, got {', '.join(name for name, _ in asked)}", asked[1][0])
        return asked[0] if asked else (None, None)

    def sampling(self, max_new_tokens: int, choice: int, adapter: str | None = None) -> SamplingParams:
        """The params for choice `choice` of n: seeded choices get seed + choice so they differ; `adapter`: the
        LoRA adapter the request's model names (None: the base model)."""
        seed = None if self.seed is None else self.seed + choice
        logprobs, prompt_logprobs = self.scoring()
        try:
            return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                  repetition_penalty=self.repetition_penalty, seed=seed,
                                  max_new_tokens=max_new_tokens, stop=tuple(self.stop or ()), ignore_eos=self.ignore_eos,
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=self.structured()[1],
                                  **({"adapter": adapter} if adapter is not None else {}))
        except ValueError as err:
            field = str(err).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise APIError(400, str(err), field) from None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


def _token_ids(v: list) -> bool:
    return all(type(t) is int for t in v)  # noqa: E721  (bools are not token ids)


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v):
        """Checked by the type of its items in one pass (pydantic's union would try each form in turn and
        build an error per item that fails: 100+ MB for a 1 MB body of one-token prompts)."""
        if isinstance(v, str) or isinstance(v, list) and (all(type(p) is str for p in v) or _token_ids(v)  # noqa: E721
                                                           or all(type(p) is list and _token_ids(p) for p in v)):
            return v
        raise ValueError("give a string, a list of strings, a list of token ids (integers) or a list of such lists")
    max_tokens: int | None = Field(16, ge=0)  # 0: with echo, score the prompt and generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, Any] | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.max_tokens == 0 and (not self.echo or self.stream):
            raise APIError(400, "max_tokens 0 generates nothing; give max_tokens >= 1, or echo: true (not streamed) "
                                "to score the prompt alone", "max_tokens")

    def scoring(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty; give a string, a list of strings or token ids", "prompt")
        return list(p)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict], None] = None
    tool_calls: list[dict] | None = None  # an assistant's calls, sent back
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def for_template(self) -> dict:
        """The message as the chat template reads it."""
        out = {"role": self.role, "content": self.text()}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        """Parts are {"type": "text", "text": str}: any other part is refused, not silently dropped."""
        for i, part in enumerate(v if isinstance(v, list) else ()):
            if part.get("type") != "text":
                raise ValueError(f"part {i} has type {str(part.get('type'))[:40]!r}; this server takes only "
                                 f"text parts: {{\"type\": \"text\", \"text\": \"...\"}}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: text must be a string, got {type(part.get('text')).__name__}")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: Function


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[str, Any] | None = None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def unsupported(self) -> None:
        if self.tool_choice is not None and not self.tools:  # before structured(), which reads the tools
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.tools and self.stream and self.logprobs and self.tool_choice != "none":
            raise APIError(400, "logprobs are not streamed with tool calls: leave logprobs out, or stream out",
                           "logprobs")
        self.named_tool()

    def named_tool(self) -> Function | None:
        """The function tool_choice names (its output is then that function's arguments), or None."""
        if not isinstance(self.tool_choice, dict):
            return None
        name = (self.tool_choice.get("function") or {}).get("name")
        tool = next((t.function for t in self.tools or () if t.function.name == name), None)
        if self.tool_choice.get("type") != "function" or tool is None:
            raise APIError(400, f"tool_choice must name one of the tools: {{\"type\": \"function\", \"function\": "
                                f"{{\"name\": ...}}}}, got {str(self.tool_choice)[:80]}", "tool_choice")
        return tool

    def structured(self) -> tuple[str | None, StructuredOutput | None]:
        """A named tool_choice constrains the output to that function's parameters, "required" to one or more
        Hermes calls of the tools (as vLLM does)."""
        field, constraint = super().structured()
        tool = self.named_tool()
        if tool is None and self.tool_choice != "required":
            return field, constraint
        if constraint is not None:
            raise APIError(400, f"ask for one structured output, got {field} and tool_choice", "tool_choice")
        if tool is None:
            return "tool_choice", StructuredOutput.grammar(required_grammar(self.template_tools()))
        return "tool_choice", StructuredOutput.json(tool.parameters or {"type": "object"})

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def scoring(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_NON_NUMBER = re.compile(rb"(?<![\w\"])-?(?:NaN|Infinity)\b")


def json_problem(body: bytes, error: str) -> str:
    """A body the JSON parser refused, explained: a lone UTF-16 surrogate escape and a NaN or Infinity literal
    get their own words; anything else the parser's."""
    if ("surrogate" in error or "hex escape" in error) and _SURROGATE.search(body):
        return (f"the body is not valid JSON: a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                f"without its pair), which is not a character: {error}")
    if _NON_NUMBER.search(body):
        return f"the body is not valid JSON (NaN and Infinity are not JSON numbers): {error}"
    return f"the body is not valid JSON: {error}"


class UnloadLoRARequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's shape): unload model `lora_name` (its running requests finish first)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)

    def unsupported(self) -> None:
        """Every field is honoured."""


class LoadLoRARequest(UnloadLoRARequest):
    """POST /v1/load_lora_adapter (vLLM's shape): load the PEFT directory `lora_path` as model `lora_name`."""

    lora_path: str = Field(min_length=1, max_length=4096)


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a JSON body (strict JSON: a NaN or Infinity literal anywhere is refused); the first
    problem becomes a 400 naming its field."""
    try:
        obj = from_json(body, allow_inf_nan=False)
    except ValueError as err:
        raise APIError(400, json_problem(body, str(err))) from None
    try:
        request = model.model_validate(obj)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{field}: {first['msg']}" if field else first["msg"], field) from None
    request.unsupported()
    return request


# -- responses ---------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def sse(obj: dict | str) -> bytes:
    """One server-sent event: a JSON object, or a literal such as [DONE]."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


_MARK = "\0text\0"  # stands for a chunk's text while its event's bytes are made
FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "error": "error", "tool_calls": "tool_calls"}


class Shape:
    """Response and chunk objects of one endpoint ("text_completion" or "chat.completion")."""

    def __init__(self, chat: bool, model: str, with_usage: bool = False):
        self.chat, self.model, self.with_usage = chat, model, with_usage  # with_usage: chunks carry "usage": null
        self.id, self.created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        self._text_events: dict[int, tuple[bytes, bytes]] = {}  # choice index -> the event around its text

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def response(self, choices: list[tuple[str | None, str, dict | None, list | None]], usage_: dict) -> dict:
        """choices: (text, finish_reason, logprobs object or None, chat tool calls or None) in index order."""
        if self.chat:
            out = [{"index": i, "message": {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})},
                    "logprobs": logprobs, "finish_reason": FINISH[reason]}
                   for i, (text, reason, logprobs, calls) in enumerate(choices)]
            return {**self._envelope("chat.completion", out), "usage": usage_}
        out = [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": FINISH[reason]}
               for i, (text, reason, logprobs, _) in enumerate(choices)]
        return {**self._envelope("text_completion", out), "usage": usage_}

    def chunk(self, index: int, text: str | None, finish: str | None = None, role: bool = False,
              logprobs: dict | None = None, delta: dict | None = None) -> dict:
        """One stream chunk for choice `index`: a text delta (with its tokens' logprobs object), a chat `delta`
        given whole (tool calls), or the final one with its finish reason."""
        reason = None if finish is None else FINISH[finish]
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            out = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
            out = self._envelope("text_completion", [choice])
        return {**out, "usage": None} if self.with_usage else out

    def text_event(self, index: int, text: str) -> bytes:
        """sse(self.chunk(index, text)) for a non-empty text, without building the object: the event's
        bytes around the text are made once per choice (a stream sends one event per token or so)."""
        around = self._text_events.get(index)
        if around is None:
            head, tail = sse(self.chunk(index, _MARK)).rsplit(json.dumps(_MARK).encode(), 1)  # text: last string
            around = self._text_events[index] = head, tail
        return around[0] + json.dumps(text).encode() + around[1]

    def usage_chunk(self, usage_: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_}
