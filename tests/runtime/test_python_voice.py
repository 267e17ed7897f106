"""The Python API's errors name its own arguments (#23: one voice per surface; engine-run's flags are checked in
test_cli_voice.py, engine-serve's JSON fields in test_server.py): each error says what is wrong and what is
allowed in the terms of the call that was made, and carries the argument at fault as `RequestError.field`."""
from __future__ import annotations

import pytest

from runtime.engine import LLM, RequestError
from runtime.manifest.load import EngineError
from runtime.request.params import SamplingParams
from runtime.speculation.speculator import Speculation


@pytest.fixture(scope="module")
def llm(trained_engine):
    with LLM(str(trained_engine), max_seq_len=256) as loaded:
        yield loaded


def test_a_missing_engine_directory_is_named_as_missing(tmp_path):
    with pytest.raises(EngineError, match="no such directory") as err:
        LLM(str(tmp_path / "nowhere"))
    assert "manifest.json" not in str(err.value)


@pytest.mark.parametrize("call, field, said", [
    (lambda llm: llm.submit("x", SamplingParams(max_new_tokens=5000)), "max_new_tokens",
     "use max_new_tokens <= 255 or load the engine with a larger max_seq_len"),
    (lambda llm: llm.submit("x", {"max_new_tokens": 3}), "params", "SamplingParams(**your_dict)"),
    (lambda llm: llm.submit(3.5), "prompt", "a prompt is a str or a sequence of int token ids, got float"),
    (lambda llm: llm.submit("x", None, Speculation("draft")), "speculation", "load with draft=DIR"),
])
def test_request_errors_name_the_python_argument(llm, call, field, said):
    with pytest.raises(RequestError) as err:
        call(llm)
    assert said in str(err.value) and "--" not in str(err.value).replace("--draft", "")  # no engine-run flags
    assert err.value.field == field


def test_load_errors_name_load_arguments(trained_engine):
    with pytest.raises(EngineError, match=r"max_seq_len 99999 is outside 2\.\.1024"):
        LLM(str(trained_engine), max_seq_len=99999)
    with pytest.raises(EngineError, match=r"max_batch_size must be an integer >= 1"):
        LLM(str(trained_engine), max_batch_size=0)
