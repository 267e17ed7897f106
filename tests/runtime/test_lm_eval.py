"""lm-evaluation-harness as a real client of engine-serve (issue 39): a small local multiple-choice task
(tests/fixtures/lm_eval/python_mc.yaml over the JSON lines beside it; no network) run through lm-eval's
`local-completions` model (its /v1/completions requests with echo, max_tokens 1 and logprobs, its own parsing)
against the trained float32 engine, and through lm-eval's own `hf` backend on the same weights in transformers:
every choice's loglikelihood within 1e-4, the same is-greedy flags, the same accuracy."""
from __future__ import annotations

from pathlib import Path

import lm_eval  # the test extra's lm-eval[api]

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tests" / "fixtures" / "lm_eval"
WEIGHTS = ROOT / "checkpoints" / "trained" / "target"
TOL = 1e-4  # a choice's loglikelihood: a sum of a few tokens' logprobs, each within 1e-4 (test_logprobs.py)


def evaluate(model: str, model_args: dict, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(TASK_DIR), include_defaults=False)  # not lm-eval's thousands of task files
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["python_mc"], task_manager=tasks,
                                   log_samples=True, **kwargs)


def test_local_completions_scores_equal_the_hf_backend(trained_server, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(TASK_DIR)  # the task's data_files path is relative to its folder
    ours = evaluate("local-completions", {"model": "trained", "base_url": f"{trained_server.url}/v1/completions",
                                          "tokenizer_backend": "huggingface", "tokenizer": str(WEIGHTS),
                                          "num_concurrent": 4, "max_retries": 1})
    theirs = evaluate("hf", {"pretrained": str(WEIGHTS), "dtype": "float32", "device": "cpu"}, batch_size=8)
    samples = {s["doc_id"]: s for s in theirs["samples"]["python_mc"]}
    assert len(ours["samples"]["python_mc"]) == len(samples) == 12
    for sample in ours["samples"]["python_mc"]:
        expected = samples[sample["doc_id"]]["resps"]
        assert len(sample["resps"]) == len(expected) == 4  # one loglikelihood request per choice
        for (got,), (want,) in zip(sample["resps"], expected):
            assert abs(got[0] - want[0]) < TOL and got[1] == want[1], (sample["doc_id"], got, want)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["python_mc"][metric] == theirs["results"]["python_mc"][metric]
    assert ours["results"]["python_mc"]["acc,none"] > 0.25  # the model knows some Python: better than chance
