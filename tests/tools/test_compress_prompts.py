"""Issue 49's on-policy data tools: the varied prompts keep the held-out questions' subjects out, and the answer
writer resumes only the same engine's answers."""
from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from builder.compress.draft import read_prompts
from tools.compress.chat_answers import read_progress
from tools.compress.make_prompts import EXCLUDED, make_prompts

EVAL = Path(__file__).resolve().parents[2] / "tools" / "compress" / "eagle_prompts_eval.txt"


def test_prompts_are_distinct_varied_reproducible_and_keep_the_held_out_subjects_out():
    prompts = make_prompts(600, seed=3)
    assert len(set(prompts)) == 600 and prompts == make_prompts(600, seed=3)
    assert not any(word in p.lower() for p in prompts for word in EXCLUDED)
    assert not set(prompts) & set(read_prompts(EVAL))
    assert len({p.split()[0] for p in prompts}) >= 10  # many kinds of request, not one template
    assert any("function" in p for p in prompts) and any(p.startswith("Summarize the following text") for p in prompts)


def test_answers_resume_only_the_same_engines(tmp_path):
    out = tmp_path / "answers.txt"
    assert read_progress(out, "e1")["done"] == 0
    out.write_text("conversations\n")
    (tmp_path / "answers.txt.progress.json").write_text(json.dumps({"engine": "e1", "done": 96, "tokens": 9,
                                                                    "seconds": 1.0}))
    assert read_progress(out, "e1")["done"] == 96
    with pytest.raises(click.UsageError, match="holds answers of e1, not e2"):
        read_progress(out, "e2")
