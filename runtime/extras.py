"""The console scripts' entry points: each checks that its optional packages are installed before anything imports
them, so a missing extra is one line naming the `pip install` that fixes it (also for --help), not a traceback."""
from __future__ import annotations

import importlib
import importlib.util
import sys

# script -> (the extra that installs what it needs, the modules it imports, the module whose main() it is)
SCRIPTS = {
    "engine-build": ("build", ("onnx", "torch", "transformers", "onnxruntime"), "builder.cli"),
    "engine-run": ("cpu", ("onnxruntime",), "runtime.cli"),
    "engine-serve": ("serve", ("fastapi", "uvicorn", "prometheus_client", "pydantic", "onnxruntime"), "runtime.serve.app"),
    "engine-bench": ("bench", ("rich", "matplotlib", "onnxruntime"), "tools.engine_bench.cli"),
    "engine-compress": ("build", ("torch", "transformers"), "builder.compress.cli"),
}


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def missing_extra_message(script: str) -> str | None:
    """One line for a script whose extra is not installed (None when everything it imports is there)."""
    extra, modules, _ = SCRIPTS[script]
    missing = missing_modules(modules)
    if not missing:
        return None
    also = ' (or ".[gpu]" on a CUDA machine: onnxruntime and onnxruntime-gpu must not both be installed)' \
        if missing == ["onnxruntime"] else ""
    return (f"error: {script} needs the [{extra}] extra, which is not installed (missing: {', '.join(missing)}): "
            f'pip install -e ".[{extra}]"{also}')


def _entry(script: str) -> None:
    if message := missing_extra_message(script):
        print(message, file=sys.stderr)
        sys.exit(1)
    importlib.import_module(SCRIPTS[script][2]).main()


def engine_build() -> None:
    _entry("engine-build")


def engine_run() -> None:
    _entry("engine-run")


def engine_serve() -> None:
    _entry("engine-serve")


def engine_bench() -> None:
    _entry("engine-bench")


def engine_compress() -> None:
    _entry("engine-compress")
