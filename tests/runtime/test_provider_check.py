"""A session that asked for CUDA and silently got the CPU is an error that says so (ONNX Runtime lists CUDA
as available even when its provider library cannot load, then runs on CPU with only a log line); the CUDA
libraries are preloaded first. On CPU, with a fake InferenceSession that reports the providers it got."""
from __future__ import annotations

import onnxruntime as ort
import pytest

from runtime.manifest.load import EngineError
from runtime.model.device import open_session


class FakeSession:
    def __init__(self, path, options, providers):
        self.providers = providers

    def get_providers(self):
        return FakeSession.got


@pytest.fixture
def fake(monkeypatch):
    preloaded = []
    monkeypatch.setattr(ort, "InferenceSession", FakeSession)
    monkeypatch.setattr(ort, "preload_dlls", lambda *a, **k: preloaded.append(True), raising=False)
    return preloaded


def test_cuda_asked_cpu_got_is_a_clear_error(fake):
    FakeSession.got = ["CPUExecutionProvider"]
    with pytest.raises(EngineError, match=r"CUDAExecutionProvider and the session runs on \['CPUExecutionProvider'\]"
                                          r".*did not load.*CUDA 13"):
        open_session("engine/model.onnx", None, [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"])
    assert fake == [True]  # the CUDA libraries were preloaded before the session opened


def test_cuda_asked_cuda_got_opens(fake):
    FakeSession.got = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    session = open_session("engine/model.onnx", None, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert session.providers[0] == "CUDAExecutionProvider" and fake == [True]


def test_cpu_sessions_preload_nothing(fake):
    FakeSession.got = ["CPUExecutionProvider"]
    open_session("engine/model.onnx", None, ["CPUExecutionProvider"])
    assert fake == []


def test_every_runner_session_goes_through_the_check(tiny_engine, monkeypatch):
    """ModelRunner's session is opened by open_session (a real CPU one here)."""
    import runtime.model.model_runner as model_runner
    from runtime.engine import LLM

    opened = []
    monkeypatch.setattr(model_runner, "open_session", lambda *a: opened.append(a) or open_session(*a))
    LLM(tiny_engine).close()
    assert len(opened) == 1 and opened[0][2] == ["CPUExecutionProvider"]


def test_one_session_serves_eager_calls_and_captured_graphs(monkeypatch):
    """On CUDA with decode buckets the one session is made with enable_cuda_graph (no second copy of the
    weights); eager calls run with gpu_graph_id -1 (ONNX Runtime's "skip capture"), each bucket with its own."""
    import runtime.model.model_runner as model_runner

    monkeypatch.setattr(model_runner, "providers", lambda manifest, device: ["CUDAExecutionProvider",
                                                                             "CPUExecutionProvider"])
    chosen = model_runner.session_providers(None, "cuda", [1, 2, 4])
    assert chosen == [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"]
    assert model_runner.session_providers(None, "cuda", []) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert model_runner.run_options(model_runner.EAGER).get_run_config_entry("gpu_graph_id") == "-1"
    assert model_runner.run_options(2).get_run_config_entry("gpu_graph_id") == "2"
    # a session that captures nothing gets no options: ONNX Runtime's wrapper would look up gpu_graph_id in
    # them per call, and a missing entry costs a C++ exception (~25 us)
    assert model_runner.run_options(None) is None


def test_a_missing_cuda_provider_says_whether_the_driver_or_the_package_is_missing(monkeypatch, tmp_path):
    """--device cuda on a machine without CUDA says there is no driver; with a driver, it names the GPU install
    that does not clash with onnxruntime (#23)."""
    import onnxruntime as ort

    from runtime.model import device

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    manifest = type("M", (), {"target": type("T", (), {"device": "cuda"})()})()
    import pathlib

    real = pathlib.Path.exists

    for has_driver, wanted in ((False, "no NVIDIA driver"), (True, "fresh virtualenv")):
        monkeypatch.setattr(pathlib.Path, "exists",
                            lambda self, has=has_driver: has if str(self) == "/proc/driver/nvidia" else real(self))
        with pytest.raises(EngineError, match=wanted) as err:
            device.providers(manifest, "cuda")
        assert "device='cpu'" not in str(err.value)  # no Python-API advice in a message every surface shows
