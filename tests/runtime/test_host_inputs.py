"""No runner binds an input from a host array that it writes again later without binding it again.

ONNX Runtime's IOBinding copies an input that lives in host memory to the session's device once, when it is
bound (CopyOneInputAcrossDevices); a later write into the host array never reaches a GPU, and every step would
read the first step's token ids. On CPU no copy happens, so generation alone cannot catch it: this audit
records every input bound from a numpy array (`OrtValue.ortvalue_from_numpy`), snapshots its bytes at binding,
and fails a run that finds them changed, except for the inputs a kernel reads on the host (HOST_READ). Each
runner runs its device path (KV backend "ortvalue"), the one CUDA runs."""
from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.capi.onnxruntime_inference_collection import IOBinding
from test_tensor_parallel import build, checkpoint  # noqa: F401 (fixtures)

from runtime.engine import LLM
from runtime.model.device import HOST_READ
from runtime.request.params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


class HostInputAudit:
    """Patches OrtValue.ortvalue_from_numpy, IOBinding's input binds and run_with_iobinding (see the module)."""

    def __init__(self, monkeypatch):
        self.host: dict[int, np.ndarray] = {}  # data pointer -> the numpy array an OrtValue wraps
        self.bound: dict[int, dict[str, tuple[int, bytes]]] = {}  # id(binding) -> name -> (pointer, bytes)
        self.violations: list[str] = []
        self.runs = 0
        wrap, bind_value, bind_pointer = (ort.OrtValue.ortvalue_from_numpy, IOBinding.bind_ortvalue_input,
                                          IOBinding.bind_input)
        run = ort.InferenceSession.run_with_iobinding

        def from_numpy(array, *args, **kwargs):
            value = wrap(array, *args, **kwargs)
            if value.device_name() == "cpu":
                self.host[value.data_ptr()] = array
            return value

        def bind_ortvalue_input(binding, name, value):
            self._record(binding, name, value.data_ptr())
            return bind_value(binding, name, value)

        def bind_input(binding, name, device_type, device_id, element_type, shape, pointer):
            self._record(binding, name, pointer)
            return bind_pointer(binding, name, device_type, device_id, element_type, shape, pointer)

        def run_with_iobinding(session, binding, options=None):
            self._check(binding)
            return run(session, binding, options)

        monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(from_numpy))
        monkeypatch.setattr(IOBinding, "bind_ortvalue_input", bind_ortvalue_input)
        monkeypatch.setattr(IOBinding, "bind_input", bind_input)
        monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run_with_iobinding)

    def _record(self, binding, name: str, pointer: int) -> None:
        entries = self.bound.setdefault(id(binding), {})
        entries.pop(name, None)  # a rebind replaces the snapshot
        if pointer in self.host and name not in HOST_READ:
            array = self.host[pointer]
            entries[name] = (pointer, ctypes.string_at(pointer, array.nbytes))

    def _check(self, binding) -> None:
        self.runs += 1
        for name, (pointer, snapshot) in self.bound.get(id(binding), {}).items():
            if ctypes.string_at(pointer, len(snapshot)) != snapshot:
                self.violations.append(f"{name}: bound from a host array, written after binding without a rebind")


@pytest.fixture
def audit(monkeypatch):
    return HostInputAudit(monkeypatch)


def test_audit_catches_a_host_input_written_after_binding(audit, tiny_engine):
    """The audit itself: a host token-id array bound once and written before the next run is reported."""
    session = ort.InferenceSession(str(tiny_engine / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.zeros((1, 1), np.int64)
    binding = session.io_binding()
    binding.bind_ortvalue_input("input_ids", ort.OrtValue.ortvalue_from_numpy(ids))
    ids[0, 0] = 7
    audit._check(binding)
    assert audit.violations == ["input_ids: bound from a host array, written after binding without a rebind"]


def generate_clean(llm, audit: HostInputAudit) -> None:
    try:
        results = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.close()
    assert all(len(r.token_ids) == GREEDY.max_new_tokens for r in results) and audit.runs > GREEDY.max_new_tokens
    assert audit.violations == []


@pytest.mark.parametrize("graph_decode", [False, True])
def test_model_runner_writes_inputs_into_device_buffers(audit, tiny_engine, graph_decode):
    generate_clean(LLM(tiny_engine, kv_backend="ortvalue", graph_decode=graph_decode), audit)


def test_tensor_parallel_rank_writes_inputs_into_device_buffers(audit, checkpoint, tmp_path_factory):  # noqa: F811
    generate_clean(LLM(build(checkpoint, tmp_path_factory.mktemp("tp-host-inputs") / "tp2", 2), kv_backend="ortvalue"),
                   audit)
