"""Runtime fixtures: the trained checkpoint's engine (its chat template comes with the checkpoint), built once per
test session."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def trained_engine(tmp_path_factory) -> Path:
    from builder.build import build_engine
    from builder.recipe import load_recipe

    recipe = load_recipe(ROOT / "build_recipes" / "trained_cpu.yaml",
                         overrides=[f"model={ROOT / 'checkpoints' / 'trained' / 'target'}"])
    return build_engine(recipe, tmp_path_factory.mktemp("serve") / "trained", log=lambda _: None)


@pytest.fixture(scope="module")
def trained_server(trained_engine):
    """engine-serve on a thread over the trained engine, served as model "trained" (one per test module)."""
    from runtime.engine import LLM
    from runtime.serve.app import create_app
    from runtime.serve.transport import RunningServer

    llm = LLM(trained_engine)
    running = RunningServer(create_app({"trained": llm}))
    yield running
    running.stop()
    llm.close()
