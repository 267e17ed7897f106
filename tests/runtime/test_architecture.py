"""The runtime's shape: no import cycle among its modules, one job per file stated in its docstring,
and one owner of sequence state (the scheduler's slot table)."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import import_graph
from import_graph import find_cycle
from runtime.model.kv_cache import KVCache
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.request.params import SamplingParams
from runtime.batching.block_table import BlockConfig
from runtime.batching.scheduler import Scheduler
from runtime.request.sequence import Sequence, Status
from tools.fake_runner import CountingRunner

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
MODULES = sorted(p for p in RUNTIME.rglob("*.py"))
# runtime/'s packages from the bottom up: a module imports only from its own layer or the ones below it.
# The top-level modules (engine.py: LLM, async_engine.py, cli.py, interrupt.py) sit above every package but serve/,
# except config.py (LoadConfig, ExecutorConfig), which the runners and the executor read: just above manifest/.
LAYERS = ["manifest", "config", "lora", "request", "model", "speculation", "batching", "parallel", "<top>", "serve"]


def module_name(path: Path) -> str:
    return import_graph.module_name(path, RUNTIME)


def layer(name: str) -> str:
    head = name.split(".")[0]
    return head if head in LAYERS else "<top>"


def runtime_imports(path: Path) -> set[str]:
    """The runtime modules `path` imports anywhere: top level, inside functions, under TYPE_CHECKING."""
    return import_graph.package_imports(path, RUNTIME)


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_runtime_has_no_import_cycle():
    graph = {module_name(p): runtime_imports(p) for p in MODULES}
    assert graph["engine"] and "engine" not in graph["batching.executor"]  # the graph is read, the old cycle is gone
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in runtime/: " + " -> ".join(cycle)


def test_no_runtime_package_imports_one_above_it():
    upward = [f"{module_name(p)} -> {dep}" for p in MODULES for dep in runtime_imports(p)
              if LAYERS.index(layer(dep)) > LAYERS.index(layer(module_name(p)))]
    assert not upward, f"runtime/ imports against the layer order {LAYERS}: {upward}"


def test_every_runtime_module_sits_in_a_known_package():
    packages = {p.name for p in RUNTIME.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS) - {"<top>", "config"}, "a new runtime package needs a place in LAYERS"
    assert {module_name(p) for p in RUNTIME.glob("*.py")} == {"__init__", "engine", "async_engine", "cli", "interrupt",
                                                              "config", "extras"}


def test_the_runtime_never_imports_the_builder():
    offenders = [module_name(p) for p in MODULES for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                     (n or "").split(".")[0] == "builder" for n in
                     ([node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]))]
    assert not offenders, f"runtime modules importing builder/: {offenders}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(RUNTIME)))
def test_every_runtime_file_states_its_job(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    name = path.relative_to(RUNTIME)
    assert doc, f"runtime/{name} has no module docstring saying what it is for"
    first = doc.splitlines()[0].strip()
    assert len(first.split()) >= 4, f"runtime/{name}: the docstring's first line {first!r} does not state a job"


WRITERS = {"_slot", "_cached", "_reused", "_recomputed", "_blocks"}  # Sequence's slot and progress, behind read-only properties


def test_only_the_kv_tables_write_sequence_progress():
    """The KV table (runtime/batching/kv_table.py's interface, slot_table.py's contiguous rows) is the one writer."""
    writers = set()
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and leaf.attr in WRITERS and not (
                            path.stem == "sequence" and isinstance(leaf.value, ast.Name) and leaf.value.id == "self"):
                        writers.add(path.name)
    assert writers == {"kv_table.py", "slot_table.py"}


def _scheduler(slots: int = 3, max_tokens: int = 8, min_reuse: int = 2) -> Scheduler:
    """Rows of 16 tokens, charged in blocks of 2 (a budget of every row's length)."""
    spec = KVCacheSpec(num_layers=1, kv_heads=1, head_dim=2, dtype="float32", slots=slots, max_seq_len=16)
    return Scheduler(KVCache(spec), slots, max_tokens, min_reuse, BlockConfig(slots * 8, 2))


def _seq(tokenizer, prompt: list[int], new: int = 4) -> Sequence:
    return Sequence(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True), tokenizer, frozenset())


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    return Tokenizer(WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))


def test_slot_table_admit_advance_finish_and_reuse(tokenizer):
    scheduler = _scheduler()
    table = scheduler.slots
    first = _seq(tokenizer, [1, 2, 3, 4, 5, 6])
    scheduler.add(first)
    plan = scheduler.schedule()  # admitted: a fresh slot, the whole prompt in one chunk
    assert first.slot == 0 and first.num_cached == 0 and first.status is Status.PREFILL
    assert plan.prefill == [(first, 6)] and table.owner[0] is first and table.free == [1, 2]
    scheduler.advance([first], 4)  # a chunk: still prefilling; the slot holds what is cached
    assert first.status is Status.PREFILL and table.held(0) == [1, 2, 3, 4]
    scheduler.advance([first], 2)
    assert first.status is Status.DECODE and first.num_uncached_prompt == 0 and table.held(0) == [1, 2, 3, 4, 5, 6]
    first.output_ids += [7, 8]
    scheduler.advance([first], 1)  # a decoded token: the row holds generated tokens' KV too
    assert first.num_cached == 7 and table.held(0) == [1, 2, 3, 4, 5, 6, 7]
    np.testing.assert_array_equal(table.positions(0, 2), [7, 0, 0])
    assert scheduler.blocks.blocks(first) == [0, 1, 2]  # its prompt's: one chunk, taken at admission

    busy = _seq(tokenizer, [1, 2, 3, 4, 5, 9])  # shares 2 full blocks with a busy row: a fresh row, KV copied
    scheduler.add(busy)
    scheduler.schedule()
    assert busy.slot == 1 and busy.reused == busy.num_cached == 4 and table.held(1) == [1, 2, 3, 4]
    # running sequences first: first's 4th block (its next token's, grown at the step), then busy's 3 prompt
    # blocks (2 of them copies), taken as it enters with this step's chunk
    assert scheduler.blocks.blocks(first) == [0, 1, 2, 3] and scheduler.blocks.blocks(busy) == [4, 5, 6]

    first.finish("length")
    scheduler.retire(first)  # the row is free again and keeps its full blocks (cached tokens) for reuse
    assert first not in scheduler.running and 0 in table.free and table.owner[0] is None
    assert table.held(0) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_array_equal(table.positions(0, 1), [6, 4])
    again = _seq(tokenizer, [1, 2, 3, 4, 5, 6, 7, 30])
    scheduler.add(again)
    scheduler.schedule()
    assert again.slot == 0 and again.reused == 6 and again.num_cached == 6 and table.free == [2]


def test_sequence_progress_is_read_only(tokenizer):
    seq = _seq(tokenizer, [1, 2, 3])
    for name in ("num_cached", "slot", "reused", "status"):
        with pytest.raises(AttributeError):
            setattr(seq, name, 1)
    assert (seq.slot, seq.num_cached, seq.reused, seq.status) == (-1, 0, 0, Status.WAITING)


def test_release_keeps_at_most_max_seq_len_minus_one_tokens(tokenizer):
    """A decode call writes an idle slot's dummy token just past what it keeps: inside the buffer."""
    scheduler = _scheduler(slots=1)
    table = scheduler.slots
    seq = _seq(tokenizer, list(range(1, 16)), new=1)
    scheduler.add(seq)
    scheduler.schedule()
    scheduler.advance([seq], 15)
    seq.output_ids.append(16)
    scheduler.advance([seq], 1)
    scheduler.retire(seq)  # 16 tokens cached; 7 full blocks of 2 (14 tokens) stay findable
    assert table.held(0) == list(range(1, 15)) and table.positions(0, 0).tolist() == [14]
    with pytest.raises(RuntimeError, match="KV slot 0 is not in use"):
        table.release(0)



def test_executor_runs_on_a_runner_without_an_llm(tokenizer):
    from runtime.batching.executor import Executor
    from runtime.config import ExecutorConfig

    runner = CountingRunner()
    executor = Executor(runner, None, ExecutorConfig(max_tokens_per_step=2), BlockConfig(16, 2))  # 3-token prompt: 2 chunks
    try:
        seq = _seq(tokenizer, [1, 2, 3], new=4)
        result = executor.submit_sequence(seq).result(timeout=10)
    finally:
        executor.shutdown()
    assert result.token_ids == [4, 5, 6, 7] and result.finish_reason == "length"
    assert runner.calls == [("extend", 0, 0, 2), ("extend", 0, 2, 1), ("decode", 0, [3]), ("decode", 0, [4]),
                            ("decode", 0, [5])]
    assert seq.num_cached == 6 and executor.scheduler.slots.free == [1, 0]
    assert executor.scheduler.slots.held(0) == [1, 2, 3, 4, 5, 6]  # the last token was never computed
    assert executor.totals["prompt_tokens_computed"] == 3 and executor.stats()["free_slots"] == 2


def test_architecture_doc_names_every_runtime_package():
    """docs/ARCHITECTURE.md's runtime map lists every runtime package and top-level module, so it cannot drift."""
    doc = (RUNTIME.parent / "docs" / "ARCHITECTURE.md").read_text()
    section = doc[doc.index("## Runtime architecture"):]
    entries = [f"{p.name}/" for p in RUNTIME.iterdir() if (p / "__init__.py").exists()]
    entries += [p.name for p in RUNTIME.glob("*.py") if p.stem != "__init__"]
    missing = [e for e in entries if f"`{e}`" not in section]
    assert not missing, f"docs/ARCHITECTURE.md's runtime architecture section lacks {missing}"


def test_a_steps_run_changes_no_sequence_state_and_postprocess_records_progress(tokenizer):
    """run (the run stage) -> a typed StepResult per sequence; the KV progress they report is recorded in one place,
    postprocess."""
    from runtime.batching.decode import StepResult
    from runtime.batching.executor import Executor
    from runtime.config import ExecutorConfig

    executor = Executor(CountingRunner(), config=ExecutorConfig(max_tokens_per_step=2))
    seq = _seq(tokenizer, [1, 2, 3], new=2)
    executor.scheduler.add(seq)
    plan = executor.scheduler.schedule()
    rows = executor.run_stage.run(plan, meanwhile=lambda: None, between=lambda ran: False).rows
    assert rows == [StepResult(seq, cached=2, prompt=True)] and seq.num_cached == 0  # a chunk short of the prompt's end
    executor._postprocess(rows)
    assert seq.num_cached == 2 and executor.totals["prompt_tokens_computed"] == 2
    executor.shutdown()


@pytest.mark.parametrize("split_kv", [0, 2048])
def test_decode_skips_idle_rows_that_keep_much_cached_kv(tokenizer, monkeypatch, split_kv):
    """A finished row between two decoding rows keeps its cached blocks: the decode goes in two calls around
    it when they hold more than SPLIT_KV tokens (a dummy token there would attend over them), else the row
    rides along; the tokens are the same."""
    from runtime.batching import decode as module
    from runtime.batching.executor import Executor, RequestHandle
    from runtime.config import ExecutorConfig

    monkeypatch.setattr(module, "SPLIT_KV", split_kv)

    runner = CountingRunner(slots=3)
    executor = Executor(runner, None, ExecutorConfig(max_tokens_per_step=64), BlockConfig(24, 2))
    seqs = [_seq(tokenizer, [1, 2, 3, 4, 5], new=n) for n in (6, 1, 6)]
    for seq in seqs:  # queued without starting the executor's thread: the test runs the steps
        executor._handles[seq.id] = RequestHandle(seq, executor)
        executor.scheduler.add(seq)
    for _ in range(3):  # prefills (the middle one finishes on its first token), then a decode step
        executor.step()
    assert [s.slot for s in seqs] == [0, 1, 2] and seqs[1].finished
    assert executor.scheduler.slots.positions(1, 1).tolist() == [4]  # two full blocks of its prompt kept
    split = [("decode", 0, [6]), ("decode", 2, [6])]
    assert runner.calls[-2:] == split if split_kv == 0 else runner.calls[-1] == ("decode", 0, [6, 4, 6])
    while not all(s.finished for s in seqs):
        executor.step()
    assert [s.output_ids for s in seqs] == [[6, 7, 8, 9, 10, 11], [6], [6, 7, 8, 9, 10, 11]]
    executor.shutdown()


# the files that may tell the KV layouts apart: the load-time choice of runner, the KV module, the paged runner
LAYOUT_READERS = {"engine", "batching.kv_layout", "batching.paged_table", "model.paged_runner"}


def _layout_checks(path: Path) -> list[str]:
    """Where `path` tells the KV layouts apart by hand: a `packed` flag (read or `getattr`), a spec's block_size,
    an isinstance check against a Paged* type."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "packed":
            found.append(f"line {node.lineno}: .packed")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and any(
                isinstance(a, ast.Constant) and a.value == "packed" for a in node.args):
            found.append(f"line {node.lineno}: getattr(..., 'packed')")
        elif isinstance(node, ast.Attribute) and node.attr == "block_size" and ast.unparse(node.value).endswith("spec"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and "Paged" in ast.unparse(node):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_kv_layout_is_told_apart_only_in_the_kv_module():
    """One KV interface (runtime/batching/kv_table.py): the executor, scheduler, decode calls and speculator never
    fork on the layout; runtime/batching/kv_layout.py picks the table, runtime/engine.py the runner."""
    forks = {module_name(p): checks for p in MODULES if not module_name(p).startswith("manifest.")
             and module_name(p) not in LAYOUT_READERS and (checks := _layout_checks(p))}
    assert not forks, f"KV layout checks outside the KV module: {forks}"


def test_a_runner_implements_every_method_it_has():
    """No runner method that raises because of the layout: a paged runner is no row runner (nor the reverse)."""
    from runtime.model.model_runner import ModelRunner
    from runtime.model.paged_runner import PagedModelRunner
    from runtime.model.runner import EngineRunner, Runner

    assert issubclass(PagedModelRunner, EngineRunner) and not issubclass(PagedModelRunner, Runner)
    assert not hasattr(PagedModelRunner, "decode") and not hasattr(PagedModelRunner, "run")
    assert issubclass(ModelRunner, Runner) and not hasattr(ModelRunner, "step")
    for cls in (PagedModelRunner, ModelRunner):
        assert "packed" not in dir(cls) and "attach" not in dir(cls)


def test_a_sequence_carries_its_blocks_while_it_holds_a_row(tokenizer):
    """The KV table's blocks for a row are the sequence's (`Sequence.blocks`, read-only): they grow with
    it, and stay with the row when it leaves."""
    scheduler = _scheduler()
    seq = _seq(tokenizer, [1, 2, 3, 4, 5, 6])
    scheduler.add(seq)
    scheduler.schedule()
    assert seq.blocks == scheduler.blocks.rows[seq.slot] == [0, 1, 2]
    scheduler.advance([seq], 6)
    assert scheduler.slots.grow(seq, 7) and seq.blocks == [0, 1, 2, 3]
    scheduler.preempt(seq)
    assert seq.blocks == [] and seq.slot == -1


def test_no_module_reads_a_packed_flag():
    """Runners have no `packed` flag any more: a `getattr(runner, "packed", False)`, even in a file that may tell
    the layouts apart, is always False and silently skips what it guards (runners say what they can instead,
    e.g. `scores_prompts`)."""
    reads = {module_name(p): [c for c in _layout_checks(p) if "packed" in c] for p in MODULES}
    assert not {name: found for name, found in reads.items() if found}


def _calls_to(path: Path, method: str) -> list[int]:
    """The lines where `path` calls a method named `method`."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == method]


def test_kv_memory_is_released_by_the_kv_table_alone():
    """Data flows one way, table -> cache: the block managers are accounting (no cache, no callback into one; a
    BlockTable lists what it drops), the contiguous KV table hands pages back, and nothing above it does."""
    import inspect

    from runtime.batching.block_pool import BlockPool
    from runtime.batching.block_table import BlockTable

    for cls in (BlockTable, BlockPool):
        assert list(inspect.signature(cls).parameters) in (["config", "rows", "max_seq_len"], ["config", "rows"])
    callers = {module_name(p) for p in MODULES if _calls_to(p, "release_row")}
    # the tables (and tensor / pipeline parallelism, whose caches forward a release to the ranks or stages, and the
    # virtual engines, which forward their slot range's to the shared cache) and nothing else
    assert callers <= {"batching.kv_table", "batching.slot_table", "parallel.runner", "parallel.rank",
                       "parallel.stage", "parallel.virtual_engines"}, callers


def test_both_block_managers_find_a_prefix_in_one_shape(tokenizer):
    """BlockTable.match and BlockPool.match answer alike (a Prefix: hashes, block ids, tokens, the holding row)."""
    from runtime.batching.block_pool import BlockPool
    from runtime.batching.block_table import Blocks, BlockTable, Prefix

    for cls in (BlockTable, BlockPool):  # one prefix search, one hashing of new blocks: Blocks'
        assert issubclass(cls, Blocks) and not {"match", "_hash_new_blocks", "used", "cached_tokens"} & set(vars(cls))
    table, pool = BlockTable(BlockConfig(8, 2), rows=2, max_seq_len=8), BlockPool(BlockConfig(8, 2), rows=2)
    for blocks in (table, pool):
        blocks.reserve(1, 5)
        blocks.register(1, [7, 8, 9, 10, 11])
        found = blocks.match([7, 8, 9, 10, 12])
        assert isinstance(found, Prefix) and found.tokens == 4 and found.blocks == blocks.rows[1][:2]
        assert found.hashes == blocks.hashes[1] and blocks.match([1, 2]) == Prefix()
    assert table.match([7, 8]).row == 1 and pool.match([7, 8]).row == -1  # a pool's blocks are any row's


def test_a_sequence_ends_in_one_place():
    """Why a sequence ends is written by Sequence.finish alone, and only the executor's `_finish` calls it (it
    retires the row and closes the handle there too): `accept` returns the reason, the renderer only renders
    (a stop string is a fact of the text, `stopped_at`), and nothing else ends a sequence."""
    assert not hasattr(Sequence, "append") and not hasattr(Sequence, "_end")
    finishers = {}
    for path in MODULES:
        tree = ast.parse(path.read_text())
        calls = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and getattr(node.func, "attr", None) == "finish" and not ast.unparse(node.func).endswith("stream.finish")]
        writes = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for node in ast.walk(f)
                  if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr in ("_reason", "finish_reason")]
        if calls or writes:
            finishers[module_name(path)] = (calls, writes)
    assert set(finishers) == {"batching.executor", "request.sequence"}, finishers
    assert len(finishers["batching.executor"][0]) == 1 and not finishers["batching.executor"][1]
    assert not finishers["request.sequence"][0] and finishers["request.sequence"][1] == ["__post_init__", "finish"]


def test_accept_says_why_a_sequence_ends_and_ends_nothing(tokenizer):
    eos = Sequence([1, 2], SamplingParams(max_new_tokens=3), tokenizer, frozenset({9}))
    assert eos.accept(5) is None and eos.accept(9) == "stop" and not eos.finished and eos.output_ids == [5, 9]
    length = _seq(tokenizer, [1, 2], new=2)
    assert length.accept(9) is None and length.accept(9) == "length" and length.finish_reason is None
    length.finish("length")
    assert length.finished and length.status is Status.FINISHED


def test_the_renderer_ends_nothing(tokenizer):
    """A stop string found while rendering is returned to the executor, which ends the sequence: the renderer
    neither writes a finish reason nor retires anything."""
    from runtime.batching.handle import RequestHandle
    from runtime.batching.render import Renderer

    seq = Sequence([1], SamplingParams(max_new_tokens=8, stop=["t3"]), tokenizer, frozenset())
    handle = RequestHandle(seq, executor=None)
    for token in (2, 3, 4):
        seq.accept(token)
    renderer = Renderer()
    renderer.owe(seq, handle, 0, 3)
    assert renderer.run() == [seq] and seq.stopped_at == 1 and seq.finish_reason == "stop"
    assert seq._reason is None and seq.finish_time is None  # not ended yet: the executor's _finish does that
    assert [handle._events.get_nowait().token_id for _ in range(handle._events.qsize())] == [2, 3]  # up to the stop
