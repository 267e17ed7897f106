"""Structured outputs (issue 39) on the trained engine: every output parses and validates against its JSON
schema (nested objects, arrays, enums, numbers, required fields), greedy and sampled; regex and Lark grammar
outputs match; constrained and free requests in one batch each give what they give alone; an invalid schema,
regex or grammar is refused before any work (a 400 naming the field over HTTP); the official openai client's
chat.completions.parse returns a valid parsed object."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from runtime.engine import LLM, RequestError
from runtime.request.params import SamplingParams
from runtime.request.structured import StructuredOutput
from runtime.serve.app import RunningServer, create_app

# bounded numbers: a 3M model left free would write digits until max_tokens
POINT = {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                          "y": {"type": "integer", "minimum": 0, "maximum": 999}},
         "required": ["x", "y"], "additionalProperties": False}
SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["name", "kind", "tags", "origin"],
               "properties": {"name": {"type": "string", "maxLength": 10}, "kind": {"enum": ["cat", "dog", "bird"]},
                              "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                              "origin": POINT, "alive": {"type": "boolean"}}},
    "array": {"type": "array", "items": POINT, "minItems": 1, "maxItems": 3},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["count", "ratio", "level"],
                "properties": {"count": {"type": "integer", "minimum": 1, "maximum": 99}, "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                               "level": {"enum": [1, 2, 3]}}},
}
PROMPTS = ["x = ", "def main(", "# config\n"]


@pytest.fixture(scope="module")
def llm(trained_engine):
    engine = LLM(trained_engine)
    yield engine
    engine.close()


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_outputs_validate_against_their_schema(llm, name):
    schema = SCHEMAS[name]
    params = [SamplingParams(max_new_tokens=120, structured=StructuredOutput.json(schema))] + [
        SamplingParams(max_new_tokens=120, temperature=1.0, seed=s, structured=StructuredOutput.json(schema))
        for s in range(2)]
    for c in llm.generate(PROMPTS[:1] * len(params), params) + llm.generate(PROMPTS, params[0]):
        assert c.finish_reason == "stop", (c.text, c.finish_reason, c.error)
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_grammar_and_json_object(llm):
    cases = [(StructuredOutput.regex(r"[a-z]{2,5}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
             (StructuredOutput.grammar('start: "def " NAME "(" ")"\nNAME: /[a-z_]{1,12}/'),
              lambda t: re.fullmatch(r"def [a-z_]{1,12}\(\)", t)),
             (StructuredOutput.json_object(), lambda t: isinstance(json.loads(t), dict))]
    for constraint, ok in cases:
        for c in llm.generate(PROMPTS, SamplingParams(max_new_tokens=120, temperature=0.8, seed=1, structured=constraint)):
            assert c.finish_reason == "stop" and ok(c.text), (constraint.kind, c.text)


def test_constrained_and_free_rows_in_one_batch(llm):
    constrained = SamplingParams(max_new_tokens=60, structured=StructuredOutput.json(SCHEMAS["numbers"]))
    free = SamplingParams(max_new_tokens=24)
    params = [constrained, free, constrained, free]
    alone = [llm.generate([p], [sp])[0].text for p, sp in zip(PROMPTS + PROMPTS[:1], params)]
    together = [c.text for c in llm.generate(PROMPTS + PROMPTS[:1], params)]
    assert together == alone


def test_greedy_rows_check_their_argmax_before_computing_a_mask(llm, monkeypatch):
    """A greedy row's grammar validates its argmax token and computes the mask only when that token is forbidden
    (runtime/request/structured.py, Guide.mask): the same tokens as masking at every step, with fewer masks."""
    from runtime.batching import executor
    from runtime.request.structured import Guide

    fills = []
    fill = Guide._fill
    monkeypatch.setattr(Guide, "_fill", lambda self: fills.append(1) or fill(self))
    params = [SamplingParams(max_new_tokens=120, structured=StructuredOutput.json(SCHEMAS[name])) for name in sorted(SCHEMAS)]
    checked = [c.token_ids for c in llm.generate(PROMPTS, params)]
    checked_fills = len(fills)
    monkeypatch.setattr(executor, "_takes_argmax", lambda params: False)  # every step masked
    masked = [c.token_ids for c in llm.generate(PROMPTS, params)]
    assert checked == masked
    assert checked_fills < len(fills) - checked_fills  # the 3M model's argmax is often not JSON: few are skipped


@pytest.mark.parametrize("constraint, words", [
    (StructuredOutput.json({"type": "object", "properties": {"a": {"type": "frob"}}}), "frob"),
    (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutput.regex("[0-9"), "unclosed character class"),
    (StructuredOutput.grammar("start: missing_rule"), "missing_rule"),
])
def test_invalid_constraints_are_refused_before_any_work(llm, constraint, words):
    before = llm.executor.totals["finished"]
    with pytest.raises(RequestError, match=re.escape(words)) as info:
        llm.submit("x", SamplingParams(structured=constraint))
    assert info.value.field == "structured" and llm.executor.totals["finished"] == before


# -- engine-serve ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(llm):
    running = RunningServer(create_app({"trained": llm}))
    yield running
    running.stop()


def chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": "trained", "messages": [{"role": "user", "content": "a point"}], **body})


def test_response_format_and_guided_fields_over_http(server):
    schema = SCHEMAS["nested"]
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    r = chat(server, response_format=fmt, max_tokens=160, n=3, temperature=1.0, seed=7)
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "trained", "messages": [{"role": "user", "content": "x"}], "response_format": fmt,
            "max_tokens": 160, "stream": True, "seed": 3}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    jsonschema.validate(json.loads("".join(e["choices"][0]["delta"].get("content", "") for e in events)), schema)
    answer = chat(server, response_format={"type": "json_object"}, temperature=0, max_tokens=100).json()["choices"][0]
    assert answer["finish_reason"] == "stop" and isinstance(json.loads(answer["message"]["content"]), dict)
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": "trained", "prompt": "x = ", "guided_regex": "[0-9]{4}", "max_tokens": 10, "seed": 1})
    assert re.fullmatch("[0-9]{4}", r.json()["choices"][0]["text"])


@pytest.mark.parametrize("body, param", [
    ({"guided_json": {"type": "frob"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}}, "response_format"),
    ({"guided_regex": "(", "max_tokens": 2}, "guided_regex"),
    ({"guided_grammar": "start: nope"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_json": {}}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "speculation": "ngram"}, "speculation"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_invalid_structured_requests_are_400(server, body, param):
    r = chat(server, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_openai_client_parse(server):
    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = pydantic.Field(ge=0, le=8)  # bounded: a 3M model left free writes digits until max_tokens

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    done = client.chat.completions.parse(model="trained", messages=[{"role": "user", "content": "a pet"}],
                                         response_format=Pet, max_tokens=60, temperature=0)
    pet = done.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")
