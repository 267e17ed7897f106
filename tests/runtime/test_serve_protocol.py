"""engine-serve's stream events: the precomputed text event is byte for byte the chunk object encoded."""
from __future__ import annotations

import json

import pytest

from runtime.serve.protocol import Shape, sse


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("with_usage", [False, True])
@pytest.mark.parametrize("text", ["x", " def main(", '"quoted" \\ back\nslash', "caf\u00e9 \u2603 \U0001f600", "\0text\0"])
def test_text_event_is_the_chunk_encoded(chat, with_usage, text):
    shape = Shape(chat, model='m "\0text\0"', with_usage=with_usage)  # a model name holding the template's mark
    for index in (0, 3, 0):  # the second event of a choice reuses its template
        event = shape.text_event(index, text)
        assert event == sse(shape.chunk(index, text))
        body = json.loads(event.decode().removeprefix("data: "))
        assert (body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]) == text
        assert ("usage" in body) == with_usage and event.endswith(b"\n\n")
