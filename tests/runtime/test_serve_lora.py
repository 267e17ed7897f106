"""engine-serve's LoRA adapters: the OpenAI `model` field picks the base model or an adapter (greedy tokens
equal transformers + PeftModel's on the same weights), /v1/models lists adapters with their parent, vLLM's
load/unload routes (behind the API key and --allow-runtime-lora; an adapter in use finishes its requests
first), 400/404 naming the problem, and per-adapter request counts on /metrics."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from runtime.engine import LLM
from runtime.serve.app import RunningServer, create_app
from lora_helpers import build_lora_engine, make_adapter, reference_greedy
from tests.runtime.test_server import metric

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]
TOKENS = 6


@pytest.fixture(scope="module")
def lora_engine(tiny_checkpoint, tmp_path_factory):
    return build_lora_engine(tiny_checkpoint, tmp_path_factory.mktemp("serve-lora") / "engine", max_adapters=2)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-adapters")
    return {"one": make_adapter(tiny_checkpoint, root / "one", seed=1),
            "two": make_adapter(tiny_checkpoint, root / "two", seed=2, r=8, targets=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def llm(lora_engine, adapter_dirs):
    loaded = LLM(lora_engine, adapters={"one": adapter_dirs["one"]})
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def app(llm):
    return create_app({"base": llm}, api_key=KEY, runtime_lora=True)


@pytest.fixture(scope="module")
def server(app):
    running = RunningServer(app)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def post(server, route: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, headers=AUTH if headers is None else headers)


def test_models_lists_adapters_with_parent(client):
    models = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(models) == {"base", "one"}
    assert models["base"]["parent"] is None and models["one"]["parent"] == "base"


def test_model_field_selects_adapter_as_peft_does(server, client, llm, tiny_checkpoint, adapter_dirs):
    before = metric(server, "engine_requests_total", model="one", status="length")
    got, want = {}, {}
    for name in ("base", "one"):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        got[name] = (r.model, r.choices[0].text)
        want[name] = (name, llm.tokenizer.decode(reference_greedy(tiny_checkpoint, adapter_dirs.get(name), PROMPT, TOKENS)))
    assert got == want and want["one"][1] != want["base"][1]  # the adapter changes the answer, as PEFT's does
    assert metric(server, "engine_requests_total", model="one", status="length") == before + 1


def test_unknown_model_is_404_naming_the_models(server):
    r = post(server, "completions", {"model": "nope", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and "'nope'" in error["message"] and "['base', 'one']" in error["message"]


def test_load_generate_unload(server, client, adapter_dirs, tiny_checkpoint):
    r = post(server, "load_lora_adapter", {"lora_name": "two", "lora_path": str(adapter_dirs["two"])})
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {"base", "one", "two"}
    r = client.completions.create(model="two", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.model == "two"
    assert post(server, "unload_lora_adapter", {"lora_name": "two"}).status_code == 200
    assert {m.id for m in client.models.list().data} == {"base", "one"}
    gone = post(server, "completions", {"model": "two", "prompt": "x", "max_tokens": 2})
    assert gone.status_code == 404 and "'two'" in gone.json()["error"]["message"]


def test_load_unload_refusals(server, app, adapter_dirs, tmp_path):
    def error(route, body, status, headers=None):
        r = post(server, route, body, headers)
        assert r.status_code == status, r.text
        return r.json()["error"]

    assert error("load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter_dirs["two"])}, 401,
                 headers={})["code"] == "invalid_api_key"
    assert "'one' has already been loaded" in error("load_lora_adapter",
                                                    {"lora_name": "one", "lora_path": str(adapter_dirs["two"])}, 400)["message"]
    assert error("load_lora_adapter", {"lora_name": "base", "lora_path": str(adapter_dirs["two"])}, 400)["param"] == \
        "lora_name"
    assert error("load_lora_adapter", {"lora_name": "x"}, 400)["param"] == "lora_path"
    missing = error("load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")}, 400)
    assert missing["param"] == "lora_path" and "'x'" in missing["message"]
    unknown = error("unload_lora_adapter", {"lora_name": "x"}, 404)
    assert unknown["code"] == "lora_adapter_not_found" and "['one']" in unknown["message"]
    app_server = app.state.server
    app_server.runtime_lora = False
    try:
        assert "--allow-runtime-lora" in error("unload_lora_adapter", {"lora_name": "one"}, 403)["message"]
    finally:
        app_server.runtime_lora = True
    assert post(server, "completions", {"model": "one", "prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_unload_in_use_lets_running_requests_finish(server, client, adapter_dirs):
    assert post(server, "load_lora_adapter", {"lora_name": "busy", "lora_path": str(adapter_dirs["two"])}).status_code == 200
    want = client.completions.create(model="busy", prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stream = client.completions.create(model="busy", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # running: it holds the adapter's slot
    with ThreadPoolExecutor(1) as pool:  # the unload answers once the running request has finished
        unload = pool.submit(post, server, "unload_lora_adapter", {"lora_name": "busy"})
        while "busy" in {m.id for m in client.models.list().data}:
            time.sleep(0.01)
        assert post(server, "completions", {"model": "busy", "prompt": "x", "max_tokens": 2}).status_code == 404
        finish = None
        for chunk in chunks:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert unload.result().status_code == 200
    assert finish == "length" and text == want


def test_lora_modules_option(lora_engine, tmp_path):
    from click.testing import CliRunner

    from runtime.serve.app import main

    def run(*args):
        return CliRunner().invoke(main, ["--engine", str(lora_engine), "--port", "0", *args])

    bad = run("--lora-modules", "no-path")
    assert bad.exit_code == 2 and "'no-path' is not NAME=PATH" in bad.output
    twice = run("--lora-modules", "a=x", "--lora-modules", "a=y")
    assert twice.exit_code == 2 and "two adapters are named 'a'" in twice.output
    missing = run("--lora-modules", f"a={tmp_path / 'none'}")
    assert missing.exit_code == 2 and "no adapter_config.json" in missing.output


@pytest.mark.parametrize("spelling", [["--lora-modules", "a=/p/a", "b=/p/b"],
                                      ["--lora-modules=a=/p/a", "b=/p/b"],
                                      ["--lora-modules", "a=/p/a", "--lora-modules", "b=/p/b"]])
def test_lora_modules_as_a_list_or_repeated(spelling, monkeypatch):
    """vLLM's spelling (values one after another) reads as the option repeated; the next option ends the list."""
    from click.testing import CliRunner

    from runtime.serve import app

    loaded = []

    def llm(path, adapters=None, **options):  # instead of loading: what the first engine was given
        loaded.append(adapters)
        raise ValueError("not loading in this test")

    monkeypatch.setattr(app, "LLM", llm)
    result = CliRunner().invoke(app.main, ["--engine", "/e", *spelling, "--port", "0"])
    assert result.exit_code == 2 and "not loading in this test" in result.output, result.output
    assert loaded == [{"a": Path("/p/a"), "b": Path("/p/b")}]


def test_a_stray_word_is_still_refused():
    from click.testing import CliRunner

    from runtime.serve.app import main

    result = CliRunner().invoke(main, ["--engine", "/e", "--port", "0", "a=/p/a"])
    assert result.exit_code == 2 and "unexpected extra argument" in result.output, result.output
