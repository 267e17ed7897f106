"""The executor's public per-step record (Executor.add_step_observer -> StepRecord): what benchmarks read instead
of patching the executor's privates. Each step of a request is recorded once, with its prompt tokens, the tokens
it generated and its decode rows, and phase times that fit inside the step."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from runtime.batching.block_table import BlockConfig
from runtime.batching.executor import Executor, StepRecord
from runtime.config import ExecutorConfig
from runtime.request.params import SamplingParams
from runtime.request.sequence import Sequence
from tools.fake_runner import CountingRunner


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))


def test_each_step_is_recorded_once_with_what_it_ran(tokenizer):
    executor = Executor(CountingRunner(slots=4, max_seq_len=32, record=False), None, ExecutorConfig(max_tokens_per_step=2), BlockConfig(64, 2))
    records: list[StepRecord] = []
    executor.add_step_observer(records.append)
    try:
        seq = Sequence([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True), tokenizer, frozenset())
        assert len(executor.submit_sequence(seq).result(timeout=10).token_ids) == 4
    finally:
        executor.shutdown()
    # a 3-token prompt in chunks of 2 and 1 (the second gives the first token), then 3 decode steps
    assert [(r.prompt_tokens, r.decode_rows, r.tokens) for r in records] == [(2, 0, 0), (1, 0, 1)] + [(0, 1, 1)] * 3
    assert len(records) == executor.totals["steps"] and not any(r.ahead for r in records)
    for record, later in zip(records, records[1:]):
        assert record.started < record.ended <= later.started
    for r in records:
        assert 0 <= r.schedule_s and 0 <= r.postprocess_s and 0 <= r.sample_s <= r.postprocess_s
        assert r.schedule_s + r.run_s + r.postprocess_s <= r.total_s


def test_a_removed_observer_hears_nothing_more(tokenizer):
    executor = Executor(CountingRunner(slots=4, max_seq_len=32, record=False), None, ExecutorConfig(max_tokens_per_step=8), BlockConfig(64, 2))
    records: list[StepRecord] = []
    executor.add_step_observer(records.append)
    executor.remove_step_observer(records.append)
    try:
        seq = Sequence([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True), tokenizer, frozenset())
        executor.submit_sequence(seq).result(timeout=10)
    finally:
        executor.shutdown()
    assert records == [] and executor.totals["steps"] == 3
