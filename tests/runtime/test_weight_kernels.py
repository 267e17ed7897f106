"""The CUDA weight-only kernel switch (runtime/model/weight_kernels.py): which kernels a session is set up for,
what the recipe records and what a load overrides. On CPU nothing is set; a CUDA session is rehearsed on
real SessionOptions (the switch is a session config entry plus ONNX Runtime's environment variable)."""
from __future__ import annotations

import json
import os
from unittest import mock

import onnxruntime as ort
import pytest

from runtime.config import LoadConfig
from runtime.manifest.load import EngineError
from runtime.model import weight_kernels as wk


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(wk.ENV, raising=False)
    yield
    os.environ.pop(wk.ENV, None)


def _entry(options: ort.SessionOptions) -> str | None:
    try:
        return options.get_session_config_entry(wk.CONFIG)
    except Exception:  # noqa: BLE001 (ONNX Runtime raises a plain RuntimeError for a key never set)
        return None


def test_cpu_sessions_are_never_touched(clean_env):
    options = ort.SessionOptions()
    for choice in wk.WEIGHT_KERNELS:
        assert wk.configure(options, choice, "fpa_intb", "cpu") == "ort"
    assert _entry(options) is None and wk.ENV not in os.environ


@pytest.mark.parametrize("load, built, want", [(None, "fpa_intb", "fpa_intb"), ("ort", "fpa_intb", "ort"),
                                               ("fpa_intb", "ort", "fpa_intb"), (None, "auto", wk.AUTO)])
def test_cuda_session_gets_the_load_choice_else_the_engines(clean_env, load, built, want):
    options = ort.SessionOptions()
    assert wk.configure(options, load, built, "cuda") == want
    on = "1" if want == "fpa_intb" else "0"
    assert _entry(options) == on and os.environ[wk.ENV] == on


def test_auto_obeys_the_users_environment(clean_env, monkeypatch):
    monkeypatch.setenv(wk.ENV, "1")
    assert wk.resolve("auto", "cuda") == "fpa_intb"
    monkeypatch.setenv(wk.ENV, "off")
    assert wk.resolve("auto", "cuda") == wk.AUTO
    assert wk.resolve("ort", "cuda") == "ort"  # an explicit choice wins over the environment


def test_bad_choices_are_refused_by_name():
    with pytest.raises(EngineError, match="weight_kernels 'cutlass' is not one of"):
        LoadConfig(weight_kernels="cutlass")
    with pytest.raises(ValueError, match="target.weight_kernels: 'cutlass' is not allowed"):
        from builder.recipe import load_recipe

        load_recipe(base={"model": "x", "target": {"weight_kernels": "cutlass"}})


def test_the_runner_sets_up_its_session_with_the_choice(trained_engine, clean_env):
    """ModelRunner hands the load's choice and the manifest's to `configure` with the session's options."""
    from runtime.engine import LLM

    with mock.patch("runtime.model.model_runner.configure", wraps=wk.configure) as spy:
        llm = LLM(trained_engine, weight_kernels="fpa_intb", max_batch_size=1)
        try:
            assert llm.runner.weight_kernels == "ort"  # a CPU session: TensorRT-LLM's kernels are CUDA's
        finally:
            llm.close()
    options, load, built, device = spy.call_args.args
    assert isinstance(options, ort.SessionOptions) and (load, built, device) == ("fpa_intb", "auto", "cpu")


def test_the_recipe_choice_is_recorded_and_old_manifests_read_auto(trained_engine):
    from runtime.manifest.types import Manifest

    data = json.loads((trained_engine / "manifest.json").read_text())
    assert data["target"]["weight_kernels"] == "auto"
    data["target"].pop("weight_kernels")  # an engine built before the field existed
    assert Manifest.from_dict(data).target.weight_kernels == "auto"


def test_build_notes_blocks_the_cuda_kernels_do_not_take():
    from builder.build import note_weight_kernels
    from builder.recipe import load_recipe

    def notes(group: int) -> list[str]:
        lines = []
        note_weight_kernels(load_recipe(base={"model": "x", "quantization": {"mode": "int8", "group_size": group},
                                              "target": {"device": "cuda", "dtype": "float16",
                                                         "weight_kernels": "fpa_intb"}}), lines.append)
        return lines

    assert "group_size 32 keeps ONNX Runtime's own kernels" in notes(32)[0]
    assert notes(128) == []
