"""KV memory by the block (issue #29): a budget smaller than the requests' KV preempts and recomputes
without changing any request's tokens or stream; resident KV follows the tokens written, not rows x
max_seq_len; prefix caching reuses whole blocks from any row with the outputs of no caching."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from runtime.batching.block_table import BlockConfig, BlockTable
from runtime.engine import LLM
from runtime.manifest.load import EngineError
from runtime.request.params import SamplingParams
from runtime.speculation.speculator import Speculation

PAGE = mmap.PAGESIZE


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    """The tiny model with a 4096-token position limit (built for 96 tokens, loaded longer)."""
    from builder.build import build_engine
    from builder.recipe import load_recipe
    from tools.checkpoints.make_checkpoint import make_checkpoint

    checkpoint = make_checkpoint(tmp_path_factory.mktemp("long") / "ckpt", max_position_embeddings=4096, seed=2)
    recipe = load_recipe(base={"model": str(checkpoint)}, overrides=["limits.max_seq_len=96"])
    return build_engine(recipe, tmp_path_factory.mktemp("long") / "engine", log=lambda _: None)


@pytest.fixture(scope="module")
def row_mb(engine) -> float:
    """MB of one max_seq_len row (96 tokens) of the tiny engine's KV."""
    llm = LLM(engine, max_batch_size=1)
    llm.close()
    return llm.spec.bytes_per_slot / 2**20


def requests(n: int, sampled: bool = False, repeat: bool = False):
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        prompt = rng.integers(4, 512, int(rng.integers(10, 40))).tolist()
        prompt = prompt + prompt[:8] if repeat else prompt  # prompt lookup finds drafts in a repeated prompt
        extra = dict(temperature=0.9, top_k=20, top_p=0.9, seed=i) if sampled else {}
        out.append((prompt, SamplingParams(max_new_tokens=int(rng.integers(30, 48)), ignore_eos=True, **extra)))
    return out


def alone(engine, reqs, speculation=None) -> list[list[int]]:
    llm = LLM(engine, max_batch_size=1)
    try:
        return [llm.generate([p], sp, speculation)[0].token_ids for p, sp in reqs]
    finally:
        llm.close()


@pytest.mark.parametrize("kind", ["greedy", "seeded", "ngram"])
def test_sixteen_requests_on_a_budget_of_four_match_running_alone(engine, row_mb, kind):
    reqs = requests(16, sampled=kind == "seeded", repeat=kind == "ngram")
    speculation = Speculation("ngram") if kind == "ngram" else None
    llm = LLM(engine, max_batch_size=16, kv_memory_mb=4 * row_mb, max_tokens_per_step=32)
    try:
        assert llm.blocks.num_blocks == 4 * 96 // 16
        handles = [llm.submit(p, sp, speculation) for p, sp in reqs]
        results = [h.result(timeout=120) for h in handles]
        streams = [[o.token_id for o in h] for h in handles]
        stats = llm.executor.stats()
    finally:
        llm.close()
    assert all(r.finish_reason == "length" for r in results)
    assert [r.token_ids for r in results] == alone(engine, reqs, speculation)
    assert streams == [r.token_ids for r in results]  # each client saw every token once, in order
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0  # the budget was really exceeded
    assert stats["kv_blocks_total"] == 24 and 0.0 <= stats["kv_waste_ratio_mean"] < 0.5


def test_resident_kv_follows_the_tokens_written(long_engine):
    """32 rows of 4096 tokens are address space: what is resident (mincore page counts of the KV buffers)
    is the pages of the tokens written, within one partly filled page per head row, and goes back to the OS
    when the requests finish (prefix caching off: nothing is kept)."""
    llm = LLM(long_engine, max_batch_size=32, max_seq_len=4096, prefix_caching=False)
    cache, spec = llm.runner.cache, llm.spec
    head_rows = 2 * spec.num_layers * spec.kv_heads  # key and value, per layer and head: one run of max_seq_len

    def pages(tokens: int) -> int:  # bytes resident for one sequence of `tokens` cached tokens
        return head_rows * -(-tokens * spec.head_dim * 4 // PAGE) * PAGE

    seen = []

    def watch(output):
        running = llm.executor.scheduler.running
        if output is not None and len(seen) < 3 and len(running) == 8:  # under the executor's lock
            cached = [s.num_cached for s in running]
            seen.append((cache.resident_bytes(), sum(pages(n) for n in cached), sum(cached)))

    try:
        assert cache.resident_bytes() == 0
        params = SamplingParams(max_new_tokens=300, ignore_eos=True)
        prompts = [[4 + (7 * j + i) % 500 for j in range(200 + 100 * i)] for i in range(8)]
        seqs = [llm.make_sequence(p, params) for p in prompts]
        handles = [llm.executor.submit_sequence(s, watch if i == 0 else None) for i, s in enumerate(seqs)]
        [h.result(timeout=120) for h in handles]
        after = cache.resident_bytes()
    finally:
        llm.close()
    assert seen, "the watched request never ran beside the seven others"
    for resident, expected, _ in seen:
        assert expected <= resident <= expected + 8 * head_rows * PAGE
    assert seen[0][0] < 0.05 * spec.bytes  # far below 32 rows x 4096 tokens
    assert after <= 32 * head_rows * PAGE  # given back (a dummy decode token may touch an idle row's first page)


def test_prefix_blocks_reused_across_rows_with_the_outputs_of_no_caching(engine):
    system = list(range(100, 132))  # two whole 16-token blocks
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [system + [5, 6, 7], system + [8], system + [9, 10]]
    outputs = {}
    for caching in (True, False):
        llm = LLM(engine, max_batch_size=4, prefix_caching=caching)
        try:
            first = llm.generate(prompts[:1], params)[0]  # finishes: its blocks stay cached in its row
            handles = []

            def then_third(output):  # on the executor thread: the second is decoding in the first one's row
                if output is not None and len(handles) == 1:
                    handles.append(llm.executor.submit_sequence(llm.make_sequence(prompts[2], params)))

            handles.append(llm.executor.submit_sequence(llm.make_sequence(prompts[1], params), then_third))
            handles[0].result(timeout=60)
            rest = [h.result(timeout=60) for h in handles]
            stats = llm.executor.stats()
        finally:
            llm.close()
        outputs[caching] = [first.token_ids] + [r.token_ids for r in rest]
        if caching:  # the first reuses the finished row in place; the second copies the blocks into another row
            assert [r.metrics["reused_prompt_tokens"] for r in rest] == [32, 32]
            assert handles[0].seq.slot != handles[1].seq.slot
            assert stats["prefix_cache_hit_tokens"] == 64
            assert stats["prefix_cache_queries_tokens"] == sum(len(p) for p in prompts)
        else:
            assert stats["prefix_cache_hit_tokens"] == 0
    assert outputs[True] == outputs[False]


def test_block_table_evicts_tail_blocks_of_the_least_recently_used_row_and_keeps_copies_findable():
    table = BlockTable(BlockConfig(6, 2), rows=3, max_seq_len=8)
    for row in (0, 1):
        table.reserve(row, 4)
        table.register(row, [1, 2, 3, 4])  # row 1 holds a copy of row 0's two blocks
        table.release(row)
    found = table.match([1, 2, 3, 4, 5])
    assert (found.row, found.tokens, found.blocks) == (0, 4, table.rows[0]) and table.used == 4
    assert not table.take_dropped()  # both rows keep their blocks cached: their KV is still wanted
    assert table.reserve(2, 6) and table.take_dropped() == [(0, 2)]  # one block needed: the LRU row's last, from token 2
    found = table.match([1, 2, 3, 4])
    assert table.cached_tokens(0) == 2 and (found.row, found.tokens) == (1, 4)  # the second found in row 1's copy
    table.evict(1)
    found = table.match([1, 2, 3, 4])
    assert table.take_dropped() == [(1, 0)] and (found.row, found.tokens) == (0, 2)  # row 0's first block still cached
    assert table.used == 4 and len(table.rows[2]) == 3
    assert not table.reserve(2, 16)  # more than the budget: nothing taken
    assert table.used == 4


def test_release_row_from_a_token_keeps_the_prefix_and_hands_back_the_tail():
    from runtime.manifest.kv_spec import KVCacheSpec
    from runtime.model.kv_cache import KVCache

    cache = KVCache(KVCacheSpec(num_layers=1, kv_heads=2, head_dim=PAGE // 4, dtype="float32", slots=2, max_seq_len=8))
    cache.keys[0][:] = 1.0  # one page per token and head
    before = cache.resident_bytes()
    cache.release_row(1, 3)
    assert before - cache.resident_bytes() == 2 * 5 * PAGE  # 5 tokens of 2 heads (before reading them again)
    assert (cache.keys[0][1, :, :3] == 1).all() and (cache.keys[0][1, :, 3:] == 0).all() and (cache.keys[0][0] == 1).all()


def test_budget_too_small_for_one_sequence_is_refused(engine, row_mb):
    with pytest.raises(EngineError, match="one sequence of max_seq_len 96 needs 6"):
        LLM(engine, kv_memory_mb=row_mb / 2)


def test_metrics_report_blocks_preemptions_and_prefix_cache(engine, row_mb):
    from runtime.serve.metrics import ServerMetrics

    llm = LLM(engine, max_batch_size=8, kv_memory_mb=2 * row_mb)
    try:
        llm.generate([p for p, _ in requests(6)], SamplingParams(max_new_tokens=40, ignore_eos=True))
        text = ServerMetrics({"tiny": llm}).render().decode()
        stats = llm.executor.stats()
    finally:
        llm.close()
    assert 'engine_kv_blocks_total{model="tiny"} 12.0' in text
    assert f'engine_preemptions_total{{model="tiny"}} {float(stats["preemptions"])}' in text
    for name in ("engine_kv_blocks_used", "engine_kv_waste_ratio", "engine_recomputed_tokens_total",
                 "engine_prefix_cache_hit_tokens_total", "engine_prefix_cache_queries_tokens_total"):
        assert f'{name}{{model="tiny"}}' in text


def test_tensor_parallel_rank0_sends_released_rows_with_its_copies():
    """Rank 0's cache queues a row it hands back beside its prefix copies; the step carries both in order."""
    from runtime.manifest.kv_spec import KVCacheSpec
    from runtime.parallel.runner import _CopyRecordingCache
    from runtime.parallel.step import RELEASED, Step

    cache = _CopyRecordingCache(KVCacheSpec(num_layers=1, kv_heads=1, head_dim=1024, dtype="float32", slots=2,
                                            max_seq_len=8))
    cache.keys[0][0] = 1.0
    cache.copy_prefix(0, 1, 4)
    cache.release_row(0)
    assert cache.pending == [(0, 1, 4), (RELEASED, 0, 0)] and not cache.keys[0][0].any()
    step = Step(0, np.zeros((1, 1), np.int64), np.zeros(1, np.int64), 1, tuple(cache.pending))
    assert Step.from_tensor(step.to_tensor()).copies == ((0, 1, 4), (RELEASED, 0, 0))


def test_free_rows_riding_along_in_decode_calls_give_up_their_cache_after_a_grace():
    """A free row a decode call covers rides along, its dummy token attending over what it keeps: its blocks
    are evicted after IDLE_GRACE such calls without reuse; a free row no call covers keeps them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from runtime.batching.slot_table import IDLE_GRACE, SlotTable
    from runtime.manifest.kv_spec import KVCacheSpec
    from runtime.model.kv_cache import KVCache
    from runtime.request.sequence import Sequence

    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))
    cache = KVCache(KVCacheSpec(num_layers=1, kv_heads=1, head_dim=2, dtype="float32", slots=4, max_seq_len=16))
    slots = SlotTable(cache, BlockTable(BlockConfig(24, 4), 4, 16))
    seqs = [Sequence([1 + row] * 9, SamplingParams(max_new_tokens=2), tokenizer, frozenset()) for row in range(4)]
    for seq in seqs:
        assert slots.admit(seq, min_reuse=4, chunk=9)  # the whole prompt: advanced at once below
        slots.advance([seq], 9)
    slots.retire(seqs[1])  # between busy rows 0 and 2: rides along
    slots.retire(seqs[3])  # above every busy row: no call covers it
    for _ in range(IDLE_GRACE - 1):
        slots.cool([1])
    assert slots.blocks.cached_tokens(1) == slots.blocks.cached_tokens(3) == 8
    slots.cool([1, 2])  # a busy row in the list is not cooled
    assert slots.blocks.cached_tokens(1) == 0 and slots.blocks.cached_tokens(3) == 8
    assert slots.positions(0, 3).tolist() == [9, 0, 9, 8]  # row 1's dummy token attends over nothing now


def test_compaction_moves_the_top_decoding_row_into_an_empty_row_below():
    """SlotTable.compact: the highest busy decoding row moves into the lowest empty row below it (its KV copied,
    its blocks and their index entries with it); a free row still keeping cached blocks is not filled, and a
    sequence not in the list (prefilling) stays."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from runtime.batching.slot_table import SlotTable
    from runtime.manifest.kv_spec import KVCacheSpec
    from runtime.model.kv_cache import KVCache
    from runtime.request.sequence import Sequence

    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))
    cache = KVCache(KVCacheSpec(num_layers=1, kv_heads=1, head_dim=2, dtype="float32", slots=5, max_seq_len=16))
    slots = SlotTable(cache, BlockTable(BlockConfig(40, 4), 5, 16))
    seqs = [Sequence([1 + row] * 9, SamplingParams(max_new_tokens=2), tokenizer, frozenset()) for row in range(5)]
    for seq in seqs:
        assert slots.admit(seq, min_reuse=4, chunk=9)
        slots.advance([seq], 9)
    for row in range(5):  # each row's KV: its row number, so a copy is visible
        cache.keys[0][row, :, :9] = row
    slots.retire(seqs[1])  # keeps its 2 cached blocks: not a hole to fill
    slots.retire(seqs[2])
    slots.evict(2)  # empty now
    top_blocks = list(slots.blocks.rows[4])
    running, decoding = [seqs[0], seqs[3], seqs[4]], {seqs[0].id, seqs[3].id, seqs[4].id}
    movable = lambda seq: seq.id in decoding  # noqa: E731
    assert slots.compact(running, movable, moves=1) == 1
    assert seqs[4].slot == 2 and slots.owner[2] is seqs[4] and slots.owner[4] is None and 4 in slots.free
    assert slots.blocks.rows[2] == top_blocks and slots.blocks.rows[4] == []
    assert (cache.keys[0][2, :, :9] == 4).all()
    assert (slots.blocks.match([5] * 9).row, slots.blocks.match([5] * 9).tokens) == (2, 8)  # found in its new row
    assert slots.blocks.cached_tokens(1) == 8  # the cached free row kept its blocks
    assert slots.compact(running, movable) == 0  # row 3 is on top now, and no empty row is below it
    slots.retire(seqs[0])
    slots.blocks.evict(0)  # an empty row below the top, but the top one is not movable (still prefilling, say)
    decoding.discard(seqs[3].id)
    assert slots.compact([seqs[3], seqs[4]], movable) == 0
    decoding.add(seqs[3].id)
    assert slots.compact([seqs[3], seqs[4]], movable) == 1 and seqs[3].slot == 0


def test_compaction_keeps_every_requests_tokens(engine):
    """Short requests finish in the low rows while a long one decodes on top: once their rows are empty it moves
    down (calls over fewer rows), and a later prompt sharing its prefix reuses its blocks from the new row; every
    request's tokens are those it gets alone."""
    long_prompt = [7 + (3 * i) % 200 for i in range(40)]
    prompts = [[5, 6, 7], [9] * 5, [11, 12] * 3, long_prompt]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 14, 16, 50)]
    llm = LLM(engine, max_batch_size=4)
    try:
        # generate queues the four at once (submit_sequences), so the long one takes the top row however the
        # submitting thread is scheduled (one submit at a time let a stalled thread find the short ones done)
        results = [c.token_ids for c in llm.generate(prompts, params)]
        moved = llm.executor.stats()["moved_sequences"]
        shared = long_prompt[:32] + [99, 98]
        reused = llm.generate([shared], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
        stats = llm.executor.stats()
    finally:
        llm.close()
    alone = LLM(engine, max_batch_size=1)
    try:
        assert results == [alone.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
        assert reused == alone.generate([shared], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    finally:
        alone.close()
    assert moved >= 1 and stats["prefix_cache_hit_tokens"] >= 32
