"""Shared fixtures: a tiny random checkpoint and its engine, built once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest

from builder.build import build_engine
from builder.recipe import load_recipe
from tools.checkpoints.make_checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", initializer_range=0.1, seed=1)


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint, tmp_path_factory) -> Path:
    recipe = load_recipe(base={"model": str(tiny_checkpoint)},
                         overrides=["limits.max_seq_len=96", "limits.max_batch_size=4"])
    return build_engine(recipe, tmp_path_factory.mktemp("engine") / "tiny", log=lambda _: None)
