"""The front door: `from runtime import LLM, AsyncLLM, SamplingParams, Speculation`, resolved lazily so that
importing `runtime` (what every CLI does before installing its Ctrl-C handling) loads nothing heavy."""
from __future__ import annotations

import subprocess
import sys

import pytest


def test_importing_runtime_loads_no_engine_and_the_names_resolve_on_use():
    code = ("import sys, runtime\n"
            "heavy = [m for m in ('runtime.engine', 'onnxruntime', 'tokenizers', 'numpy') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "from runtime import LLM, AsyncLLM, SamplingParams, Speculation\n"
            "from runtime.engine import LLM as L\n"
            "from runtime.async_engine import AsyncLLM as A\n"
            "from runtime.request.params import SamplingParams as P\n"
            "from runtime.speculation.speculator import Speculation as S\n"
            "assert (LLM, AsyncLLM, SamplingParams, Speculation) == (L, A, P, S)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_an_unknown_name_is_refused_with_the_public_names():
    import runtime

    with pytest.raises(AttributeError, match="public names are .*'LLM'"):
        runtime.Engine  # noqa: B018
    assert {"LLM", "AsyncLLM", "SamplingParams", "Speculation"} <= set(dir(runtime))
