"""What prefix caching costs at a 0% hit rate (issue 29), caching on and off alternately, median of 5.

`python -m tools.bench.kv_overhead`: the executor alone, on a runner that returns at once (64 requests of
random prompts on 16 rows). `python -m tools.bench.kv_overhead ENGINE [RUNS]`: 16 mixed-length requests
(prompts 16-512, outputs 16-256) from 16 clients on the engine with one ONNX Runtime thread, RUNS pairs
(default 5), timed in process CPU seconds as well as wall time (CPU time holds up better on a shared machine)."""
from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from runtime.batching.block_table import BlockConfig
from runtime.batching.executor import Executor
from runtime.config import ExecutorConfig
from runtime.request.params import SamplingParams
from runtime.request.sequence import Sequence
from tools.fake_runner import CountingRunner

VOCAB, ROWS, PROMPT, NEW, REQUESTS = 32, 16, 300, 300, 64


def serve(caching: bool, tokenizer: Tokenizer) -> tuple[float, int]:
    """Seconds to serve the requests, and the prompt tokens the prefix cache found."""
    rng = np.random.default_rng(0)
    blocks = BlockConfig(ROWS * (PROMPT + NEW) // 16, 16, caching)
    runner = CountingRunner(ROWS, PROMPT + NEW, VOCAB, record=False)  # no model: the executor's own cost
    executor = Executor(runner, None, ExecutorConfig(max_tokens_per_step=512), blocks)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    seqs = [Sequence(rng.integers(4, VOCAB, PROMPT).tolist(), params, tokenizer, frozenset()) for _ in range(REQUESTS)]
    start = time.perf_counter()
    for handle in [executor.submit_sequence(s) for s in seqs]:
        handle.result()
    seconds = time.perf_counter() - start
    hits = executor.stats()["prefix_cache_hit_tokens"]
    executor.shutdown()
    return seconds, hits


def on_engine(engine: str, runs: int = 5) -> None:
    from runtime.engine import LLM
    from tools.engine_bench import workloads as wl
    from tools.engine_bench.config import LengthDist
    from tools.engine_bench.drivers import inflight

    llm = LLM(engine, max_batch_size=16, threads=1)
    shapes = wl.mixed(16, LengthDist.parse("uniform:16:512"), LengthDist.parse("uniform:16:256"), 0)
    wl.check_fits(shapes, llm.max_seq_len, "kv_overhead")
    blocks = {True: llm.blocks, False: dataclasses.replace(llm.blocks, prefix_caching=False)}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    wall: dict[bool, list[float]] = {True: [], False: []}
    for run in range(runs):
        for caching in (True, False):
            start = time.process_time()
            m = inflight(llm, wl.materialize(shapes, llm.manifest.vocab_size, [run, caching]), 16,
                         blocks=blocks[caching])
            cpu[caching].append(time.process_time() - start)
            wall[caching].append(m.wall_s)
    llm.close()
    on, off = np.median(cpu[True]), np.median(cpu[False])
    pairs = np.array(cpu[True]) / np.array(cpu[False])
    print(f"{engine}: CPU s caching on {on:.2f}, off {off:.2f}, on/off {on / off:.3f} (per pair: median "
          f"{np.median(pairs):.3f}, min {pairs.min():.3f}, max {pairs.max():.3f}, {runs} pairs); wall s on "
          f"{np.median(wall[True]):.2f}, off {np.median(wall[False]):.2f}")


def main() -> None:
    if len(sys.argv) > 1:
        return on_engine(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    times: dict[bool, list[float]] = {True: [], False: []}
    hits = 0
    for _ in range(5):
        for caching in (True, False):
            seconds, found = serve(caching, tokenizer)
            times[caching].append(seconds)
            hits += found
    on, off = np.median(times[True]), np.median(times[False])
    print(f"{REQUESTS} requests x ({PROMPT} prompt + {NEW} new) on {ROWS} rows, no model, prefix cache hits {hits}: "
          f"caching on {on:.3f} s, off {off:.3f} s, on/off {on / off:.3f}")


if __name__ == "__main__":
    main()
