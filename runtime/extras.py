"""The console scripts' entry points: each checks that its optional packages are installed before anything imports
them, so a missing extra is one line naming the `pip install` that fixes it, not a traceback; `--help` still
prints what the command does (its module's docstring, read without importing it) and that line."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

# script -> (the extra that installs what it needs, the modules it imports, the module whose main() it is)
SCRIPTS = {
    "engine-build": ("build", ("onnx", "torch", "transformers", "onnxruntime"), "builder.cli"),
    "engine-run": ("cpu", ("onnxruntime",), "runtime.cli"),
    "engine-serve": ("serve", ("fastapi", "uvicorn", "prometheus_client", "pydantic", "llguidance", "onnxruntime"),
                     "runtime.serve.app"),
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


def help_without_extra(script: str) -> str:
    """The help a script can give before its extra is installed: what it does and how to get the rest."""
    extra, _, module = SCRIPTS[script]
    source = Path(importlib.util.find_spec(module).origin).read_text()
    about = ast.get_docstring(ast.parse(source)) or ""
    return (f"Usage: {script} [OPTIONS]\n\n{about}\n\nIts options are listed here once the [{extra}] extra is "
            f'installed: pip install -e ".[{extra}]"')


def _entry(script: str) -> None:
    if message := missing_extra_message(script):
        if {"-h", "--help"} & set(sys.argv[1:]):
            print(help_without_extra(script))
        print(message, file=sys.stderr)
        sys.exit(0 if {"-h", "--help"} & set(sys.argv[1:]) else 1)
    if script in ("engine-run", "engine-serve"):  # under torchrun, a stage rank serves its stage instead
        from runtime.parallel.launch import stage_rank_runs

        stage_rank_runs(sys.argv[1:], named=script == "engine-serve")
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
