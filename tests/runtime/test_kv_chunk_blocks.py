"""A prompt takes its KV blocks chunk by chunk as the scheduler runs it (issue #29, vLLM's accounting): the
blocks running sequences hold are their cached tokens plus this step's, so a long prompt does not hold its
whole reservation for the steps its later chunks wait, and waste is only the unfilled tail of each row."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from runtime.batching.block_table import BlockConfig
from runtime.batching.scheduler import Scheduler
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.model.kv_cache import KVCache
from runtime.request.params import SamplingParams
from runtime.request.sequence import Sequence, Status

TOKENIZER = Tokenizer(WordLevel({str(i): i for i in range(512)}, unk_token="0"))


def scheduler(num_blocks: int, chunk: int = 32, rows: int = 4) -> Scheduler:
    cache = KVCache(KVCacheSpec(num_layers=1, kv_heads=1, head_dim=2, dtype="float32", slots=rows, max_seq_len=256))
    return Scheduler(cache, rows, chunk, blocks=BlockConfig(num_blocks, 16, prefix_caching=False))


def sequence(prompt_len: int, start: int = 4, new: int = 8) -> Sequence:
    ids = [start + i % 400 for i in range(prompt_len)]
    return Sequence(ids, SamplingParams(max_new_tokens=new, ignore_eos=True), TOKENIZER, frozenset())


def run(s: Scheduler, plan) -> None:
    """What the executor records after the engine computed the plan (decode rows produce a token)."""
    for seq, n in plan.prefill:
        s.advance([seq], n)
    for seq in plan.decode:
        seq.accept(7)
    if plan.decode:
        s.advance(plan.decode, 1)


def test_a_long_prompt_takes_blocks_for_each_chunk_as_it_runs():
    s = scheduler(num_blocks=64)
    seq = sequence(200)
    s.add(seq)
    held = []
    while seq.status is not Status.DECODE:
        plan = s.schedule()
        assert plan.prefill == [(seq, min(32, 200 - seq.num_cached))]
        held.append(len(s.blocks.rows[seq.slot]))
        run(s, plan)
    assert held == [2, 4, 6, 8, 10, 12, 13]  # ceil((cached + chunk) / 16): never the whole prompt ahead
    plan = s.schedule()
    assert plan.decode == [seq] and len(s.blocks.rows[seq.slot]) == 13  # token 201 fits the 13th block
    stats = s.kv_stats()
    assert stats["kv_waste_ratio"] < 16 / (13 * 16)  # the unfilled tail of one block
    assert stats["kv_live_tokens_now"] == 200  # cached at the last step; the sums over steps keep their old names
    assert stats["kv_live_token_steps"] == stats["kv_live_tokens"] == 32 * sum(range(7)) + 200
    assert stats["kv_allocated_token_steps"] == stats["kv_allocated_tokens"] == 16 * (sum(held) + 13)


def test_a_waiting_prompt_enters_a_row_only_with_a_chunk_to_compute_this_step():
    s = scheduler(num_blocks=64, chunk=64)
    first, second = sequence(200), sequence(200, start=100)
    s.add(first)
    s.add(second)
    plan = s.schedule()
    assert plan.prefill == [(first, 64)] and second.status is Status.WAITING  # the budget went to `first`
    for _ in range(3):  # first's chunks 2-4 (64, 64, 8 tokens); second enters with the 56 left in step 4
        run(s, plan)
        plan = s.schedule()
    assert plan.prefill == [(first, 8), (second, 56)] and len(s.blocks.rows[second.slot]) == 4


def test_growth_that_does_not_fit_preempts_the_most_recently_admitted_sequence():
    s = scheduler(num_blocks=16, chunk=128)  # 256 tokens of KV for two 100-token prompts that keep decoding
    old, young = sequence(100, new=64), sequence(100, start=100, new=64)
    s.add(old)
    s.add(young)
    plan = s.schedule()
    assert plan.prefill == [(old, 100), (young, 28)]  # both admitted: young's first chunk is what budget is left
    for _ in range(40):
        if s.counters["preemptions"]:
            break
        run(s, plan)
        plan = s.schedule()
    assert young.status is Status.WAITING and s.waiting[0] is young and plan.decode == [old]
    assert len(s.blocks.rows[old.slot]) == 9  # old's 129th token took the block young held
    old.finish("length")
    s.retire(old)
    plan = s.schedule()  # young recomputes its prompt and the tokens it had generated
    assert plan.prefill == [(young, len(young.prefill_ids))] and young.recomputed > 0


@pytest.mark.parametrize("chunk", [16, 48])
def test_admission_needs_only_the_first_chunk(chunk):
    s = scheduler(num_blocks=16, chunk=chunk)
    seq = sequence(250)  # 16 blocks in all: the whole budget
    s.add(seq)
    s.schedule()
    assert seq.slot >= 0 and len(s.blocks.rows[seq.slot]) == -(-chunk // 16)
