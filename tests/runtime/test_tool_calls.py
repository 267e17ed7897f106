"""Tool calls (issue 39): `tools` rendered by a Hermes-style (Qwen-family) chat template exactly as transformers'
apply_chat_template(tools=...) renders them, assistant tool calls and `tool` messages sent back rendered too,
`<tool_call>{json}</tool_call>` output parsed into OpenAI's tool_calls, and a tool_choice that names a function
answered with arguments valid against its parameters. A template that does not render tools (SmolLM2's) gets them
described in the system message, in the same Hermes form."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import pytest
from tokenizers import Tokenizer

from runtime.engine import LLM
from runtime.request.chat import GuardedChat, render_chat
from runtime.request.tools import ToolCallStream, parse_hermes
from runtime.serve.app import RunningServer, create_app

HERMES = """{%- if tools %}<|im_start|>system
You are a helpful assistant.

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")  # SmolLM2-135M-Instruct's
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}
CONVERSATION = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


@pytest.fixture(scope="module")
def hermes_engine(trained_engine, tmp_path_factory) -> Path:
    """The trained engine with a Hermes-style template that renders tools."""
    engine = Path(shutil.copytree(trained_engine, tmp_path_factory.mktemp("hermes") / "hermes"))
    (engine / "chat_template.jinja").write_text(HERMES)
    return engine


def test_tools_render_as_transformers_renders_them(hermes_engine):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(hermes_engine / "tokenizer.json"), chat_template=HERMES)
    tok = Tokenizer.from_file(str(hermes_engine / "tokenizer.json"))
    as_objects = [{**m, "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": json.loads(
        CALL["function"]["arguments"])}}]} if m.get("tool_calls") else m for m in CONVERSATION]
    theirs = reference.apply_chat_template(as_objects, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    ours = GuardedChat(hermes_engine, tok, CONVERSATION, tools=[WEATHER])
    assert ours.text == theirs  # arguments sent as JSON text reach the template as an object, as vLLM gives them
    assert '"name": "get_weather"' in ours.text and "<tool_response>\n{\"temp\": 21}" in ours.text
    assert ours.ids() == list(reference.apply_chat_template(as_objects, tools=[WEATHER], tokenize=True,
                                                            add_generation_prompt=True, return_dict=False))


def test_tools_go_into_the_system_message_of_a_template_without_them(tmp_path):
    """SmolLM2's template never reads `tools`: they are described in the system message (after the caller's own,
    or as the only one), the assistant's call and the tool's answer as Hermes text, so the conversation renders."""
    (tmp_path / "chat_template.jinja").write_text(SMOLLM2)
    described = ("You may call functions to answer. Their signatures, one JSON object a line, are within <tools></tools> "
                 f"tags:\n<tools>\n{json.dumps(WEATHER)}\n</tools>\n\nTo call one, answer with a JSON object of the "
                 "function's name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    assert render_chat(tmp_path, CONVERSATION, tools=[WEATHER]) == (
        f"<|im_start|>system\n{described}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>tool\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n")
    system = [{"role": "system", "content": "Be brief."}, CONVERSATION[0]]
    assert render_chat(tmp_path, system, tools=[WEATHER]).startswith(f"<|im_start|>system\nBe brief.\n\n{described}<|im_end|>")
    assert render_chat(tmp_path, system) == render_chat(tmp_path, system, tools=[])  # no tools: the template alone


def test_described_tools_cannot_open_a_turn(hermes_engine, tmp_path):
    """Special-token text in a tool's description is marked as message content is: plain text in the ids."""
    engine = Path(shutil.copytree(hermes_engine, tmp_path / "smollm2"))
    (engine / "chat_template.jinja").write_text(SMOLLM2)
    tok = Tokenizer.from_file(str(engine / "tokenizer.json"))
    special = next(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
    attack = {**WEATHER, "function": {**WEATHER["function"], "description": f"x{special}y"}}
    clean, attacked = (GuardedChat(engine, tok, CONVERSATION[:1], tools=[tool]) for tool in (WEATHER, attack))
    assert f"x{special}y" in attacked.text
    assert attacked.ids().count(tok.token_to_id(special)) == clean.ids().count(tok.token_to_id(special))


def test_parse_hermes():
    content, calls = parse_hermes('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                  '</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather", "f"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"} and calls[0]["id"].startswith("call_")
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_hermes("plain text") == ("plain text", [])


@pytest.fixture(scope="module")
def server(hermes_engine, trained_engine):
    engines = {"hermes": LLM(hermes_engine, check_files=False), "trained": LLM(trained_engine)}  # its template replaced
    running = RunningServer(create_app(engines))
    yield running
    running.stop()
    for llm in engines.values():
        llm.close()


def chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={"model": "hermes", **body})


def test_named_tool_choice_answers_valid_arguments(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(server, messages=CONVERSATION[:1], tools=[WEATHER], tool_choice=named, max_tokens=60)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_required_tool_choice_calls_one_of_the_tools(server):
    """tool_choice "required": the output is constrained to Hermes calls of the tools given, each with arguments
    valid against its own parameters (the 3M model would never call one by itself)."""
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, clock)}
    for seed in range(3):
        r = chat(server, messages=CONVERSATION[:1], tools=[WEATHER, clock], tool_choice="required", max_tokens=120,
                 temperature=1.0, seed=seed)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"], choice
        for call in choice["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def stream_chat(server, **body) -> list[dict]:
    """The choice deltas and finish reasons of a streamed chat, in order."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": "hermes", "stream": True, **body}) as s:
        return [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]


def test_streamed_named_tool_call_sends_its_arguments_as_they_come(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": CONVERSATION[:1], "tools": [WEATHER], "tool_choice": named, "max_tokens": 60, "temperature": 0}
    whole = chat(server, **body).json()["choices"][0]["message"]["tool_calls"][0]
    chunks = stream_chat(server, **body)
    deltas = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    # how many deltas depends on timing: outputs that queue up while the client is written to go out as one text
    # (runtime/serve/stream.py); the piece-by-piece shape is pinned without a server below
    assert deltas and deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    assert all(d["index"] == 0 and "id" not in d and "name" not in d["function"] for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == whole["function"]["arguments"]
    assert chunks[-1]["finish_reason"] == "tool_calls" and not any(c["delta"].get("content") for c in chunks)


def test_streamed_auto_tool_calls_with_the_openai_client(server):
    """Content before the call streams as content; the call goes out as one tool_calls delta when the answer ends,
    and the official client reads the deltas."""
    import openai

    grammar = ('start: "Let me look.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
               '{\\"city\\": \\"Oslo\\", \\"unit\\": \\"C\\"}}\\n</tool_call>"')
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="hermes", messages=CONVERSATION[:1], tools=[WEATHER], stream=True,
                                            max_tokens=60, extra_body={"guided_grammar": grammar})
    content, calls, reasons = "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Let me look." and reasons[-1] == "tool_calls"
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "C"}


def test_auto_tool_calls_are_parsed_and_round_trip(server):
    """The model's Hermes output (forced here by a grammar: the 3M model never learned tools) becomes tool_calls;
    sending the call and its result back is a valid conversation."""
    grammar = 'start: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Oslo\\", \\"unit\\": \\"C\\"}}\\n</tool_call>"'
    r = chat(server, messages=CONVERSATION[:1], tools=[WEATHER], guided_grammar=grammar, max_tokens=60)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    back = CONVERSATION[:1] + [{"role": "assistant", "content": None, "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": call["id"], "content": "11 degrees"}]
    r = chat(server, messages=back, tools=[WEATHER], max_tokens=4)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_tools_on_a_template_without_them_are_served(server):
    """The trained model's template never reads tools: they reach it in the system message, and its answer (forced
    to a call here: the 3M model never learned tools) comes back as tool_calls; the call sent back renders."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(server, model="trained", messages=CONVERSATION[:1], tools=[WEATHER], tool_choice=named, max_tokens=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text
    r = chat(server, model="trained", messages=CONVERSATION, tools=[WEATHER], max_tokens=4)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "stream": True, "logprobs": True}, "logprobs"),
])
def test_tool_requests_refused_name_the_field(server, body, param):
    r = chat(server, messages=CONVERSATION[:1], **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_named_tool_call_streams_each_piece_of_its_arguments_as_its_own_delta():
    """ToolCallStream with a named function: the first piece comes with the call's id and name, every later piece
    as arguments alone, nothing held back, and the pieces add up to the arguments."""
    stream, pieces = ToolCallStream("get_weather"), ['{"city"', ': "Oslo', '"', "", ', "unit": "C"}']
    deltas = [d["tool_calls"][0] for piece in pieces for d in stream.feed(piece)]
    assert len(deltas) == 4 and deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    assert all(d["index"] == 0 and "id" not in d and "name" not in d["function"] for d in deltas[1:])
    assert [d["function"]["arguments"] for d in deltas] == [p for p in pieces if p]
    assert stream.end() == []
