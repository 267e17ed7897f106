"""The measurement plan: for every workload and point, the modes that serve the same request
shapes, repeated `runs` times (runs interleaved so that drift hits every mode alike)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from runtime.batching.block_table import BlockConfig
from runtime.speculation.speculator import Speculation, draft_kind, draft_problem
from tools.engine_bench import workloads as wl
from tools.engine_bench.config import MODES, BenchConfig
from tools.engine_bench.drivers import HFBatch, Measurement, RunnerBatch, inflight, static
from tools.engine_bench.metrics import summarize
from tools.bench.stats import median_of_runs

INFLIGHT, STATIC, SINGLE, HF = MODES
REUSE_ON, REUSE_OFF = "reuse on", "reuse off"
SLOTS, BLOCKS, CACHE_ON, CACHE_OFF = "slots (rows = budget / max_seq_len)", "blocks", "cache on", "cache off"
NO_SPEC = "no speculation"
NO_REUSE = 10**9  # min_prefix_reuse that no prompt reaches


@dataclass
class Task:
    workload: str
    point: str
    mode: str
    serve: Callable[[list[int]], Measurement]  # content seed -> measurement


class Suite:
    """Builds the tasks for one engine (and optionally its transformers checkpoint) and runs them."""

    def __init__(self, cfg: BenchConfig, llm, hf: HFBatch | None):
        self.cfg, self.llm, self.hf = cfg, llm, hf
        self.slots = llm.spec.slots
        self.vocab = llm.manifest.vocab_size
        self.static_batch = RunnerBatch(llm.runner)

    @property
    def skipped(self) -> list[str]:
        c, out = self.cfg, []
        if "concurrency" in c.workload:
            out += [f"concurrency {n} > {self.slots} KV slots" for n in c.concurrency if n > self.slots]
        if "speculative" in c.workload:
            out += [f"speculative C={n} > {self.slots} KV slots" for n in c.spec_concurrency if n > self.slots]
            if "draft" in c.speculate and self.llm.draft_runner is None:
                out.append("speculative draft: the engine has no draft engine (build one with a `speculative:` "
                           "recipe section, or pass --draft DIR)")
        return out

    @property
    def draft_label(self) -> str:
        """'draft (self, int4_awq)' for a quantized build of the target's own checkpoint, else
        'draft (<N>M-parameter model)'."""
        draft = self.llm.draft_runner
        if draft is None:
            return "draft"
        ours, theirs = self.llm.manifest.model, draft.manifest.model
        if ours.config_sha256 == theirs.config_sha256:
            return f"draft (self, {draft.manifest.quantization.mode})"
        return f"draft ({theirs.num_parameters / 1e6:.1f}M-parameter model)"

    def tasks(self) -> list[Task]:
        build = {"fixed": self._fixed, "stream": self._stream, "concurrency": self._concurrency,
                 "prefix": self._prefix, "speculative": self._speculative, "kv": self._kv}
        return [t for name in self.cfg.workload for t in build[name]()]

    def run(self, progress: Callable[[str], None] = lambda _: None,
            measured: Callable[[dict], None] = lambda _: None) -> dict:
        """results[workload][point][mode] = the median summary over runs. `measured` gets the
        results so far after every measurement."""
        tasks, collected = self.tasks(), {}
        self.warm_up()
        for run in range(self.cfg.runs):
            for i, t in enumerate(tasks):
                progress(f"{t.workload} {t.point} {t.mode} (run {run + 1}/{self.cfg.runs})")
                m = t.serve([self.cfg.seed, run, i])
                collected.setdefault((t.workload, t.point, t.mode), []).append(summarize(m))
                measured(_medians(collected))
        return _medians(collected)

    def warm_up(self) -> None:
        short = [wl.FIRST_ID] * 4
        self.static_batch([wl.Request(short, 2) for _ in range(self.slots)])
        self.llm.runner.extend(0, 0, short)
        if self.hf is not None:
            self.hf([wl.Request(short, 2)] * 2)

    # -- workloads ------------------------------------------------------------------------------
    def _executor_options(self, **more) -> dict:
        """The in-flight executor's options every workload runs with (ExecutorConfig fields), and `more`."""
        return {"max_tokens_per_step": self.cfg.max_tokens_per_step, "compaction": self.cfg.compaction, **more}

    def _modes(self, workload: str, point: str, shapes: list[wl.Shape], clients: int | None = None,
               single: bool = True, hf: bool = True) -> list[Task]:
        """The same shapes served by in-flight batching, static batching, one request at a time
        and transformers (when a checkpoint is given)."""
        wl.check_fits(shapes, self.llm.max_seq_len, f"{workload} {point}")
        reqs = lambda seed: wl.materialize(shapes, self.vocab, seed)  # noqa: E731
        opts = self._executor_options()
        rows = {"max_running": self.cfg.max_running} if self.cfg.max_running else {}
        tasks = [Task(workload, point, INFLIGHT, lambda s: inflight(self.llm, reqs(s), clients, **opts, **rows)),
                 Task(workload, point, STATIC, lambda s: static(self.static_batch, reqs(s), self.slots, clients))]
        if single:  # open loop: the executor admits one at a time; closed loop: one client
            tasks.append(Task(workload, point, SINGLE, lambda s: inflight(
                self.llm, reqs(s), None if clients is None else 1, max_running=1, **opts)))
        if hf and self.hf is not None:
            tasks.append(Task(workload, point, HF, lambda s: static(self.hf, reqs(s), self.slots, clients)))
        return [t for t in tasks if t.mode in self.cfg.modes]

    def _fixed(self) -> list[Task]:
        c = self.cfg
        return [t for b in c.batch for t in self._modes("fixed", f"batch={b}", wl.fixed(b, c.input_len, c.output_len))]

    def _stream(self) -> list[Task]:
        c = self.cfg
        shapes = wl.stream(c.num_requests, c.rate, c.input_len_dist, c.output_len_dist, c.seed)
        return self._modes("stream", f"rate={c.rate:g}/s", shapes)

    def _concurrency(self) -> list[Task]:
        """Closed loop at each client count; single-stream and transformers at the top level only."""
        c = self.cfg
        levels = [n for n in c.concurrency if n <= self.slots]
        if not levels:
            return []
        count = lambda n: max(c.min_sweep_requests, n * c.requests_per_client)  # noqa: E731
        pool = wl.mixed(count(max(levels)), c.input_len_dist, c.output_len_dist, c.seed)
        top = max(levels)
        return [t for n in levels for t in self._modes("concurrency", f"C={n}", pool[:count(n)], n,
                                                       single=n == top, hf=n == top)]

    def _prefix(self) -> list[Task]:
        """Requests sent one after another, all starting with the same system prompt."""
        c = self.cfg
        point = f"prefix={c.prefix_len}"

        def reqs(seed: list[int]) -> list[wl.Request]:
            return wl.shared_prefix(c.prefix_requests, c.prefix_len, c.suffix_len_dist, c.prefix_output_len,
                                    self.vocab, c.seed, seed)

        wl.check_fits(reqs([0]), self.llm.max_seq_len, f"prefix {point}")
        opts = self._executor_options()
        return [Task("prefix", point, REUSE_ON, lambda s: inflight(self.llm, reqs(s), 1, **opts)),
                Task("prefix", point, REUSE_OFF, lambda s: inflight(self.llm, reqs(s), 1, min_prefix_reuse=NO_REUSE,
                                                                   **opts))]

    def _speculative(self) -> list[Task]:
        """Greedy requests on held-out code, one point per prompt kind and client count: no
        speculation, then each method, on the same prompts (no prefix reuse between them)."""
        c = self.cfg
        opts = self._executor_options(min_prefix_reuse=NO_REUSE)
        kind = draft_kind(self.llm.draft_runner)  # 'draft' needs a draft engine, 'eagle' an EAGLE head
        methods = [m for m in c.speculate if draft_problem(m, kind) is None]
        configs = [(NO_SPEC, None)] + [
            (self.draft_label if m == "draft" else m, Speculation(m, num_draft=c.num_draft, max_draft=max(8, c.num_draft)))
            for m in methods]
        tasks = []
        for kind in c.spec_prompts:
            reqs = wl.text_prompts(self.llm, kind, c.spec_requests, c.spec_prompt_len, c.spec_output_len)
            wl.check_fits(reqs, self.llm.max_seq_len, f"speculative {kind}")
            for n in [n for n in c.spec_concurrency if n <= self.slots]:
                for label, spec in configs:
                    tasks.append(Task("speculative", f"{kind} C={n}", label,
                                      lambda s, r=reqs, n=n, sp=spec: inflight(self.llm, r, n, sp, **opts)))
        return tasks


    def _kv(self) -> list[Task]:
        """KV memory by the block (#29): a mixed-length trace on a budget of `kv_rows` max_seq_len rows, served
        as the old slot policy did (at most kv_rows sequences) and by blocks (every row the engine loaded);
        2x overload of that budget (every request must complete); a shared system prompt with staggered
        arrivals and a trace without shared prefixes, prefix caching on and off."""
        c, llm = self.cfg, self.llm
        spec = llm.spec
        budget = BlockConfig.for_budget(c.kv_rows * spec.bytes_per_slot, spec.bytes_per_slot // spec.max_seq_len,
                                        spec.max_seq_len, llm.blocks.block_size, True, llm.blocks.identity)
        opts = self._executor_options()
        trace = wl.mixed(c.kv_requests, c.kv_prompt_len_dist, c.kv_output_len_dist, c.seed)
        wl.check_fits(trace, spec.max_seq_len, "kv mixed trace")
        reqs = lambda shapes: lambda seed: wl.materialize(shapes, self.vocab, seed)  # noqa: E731
        clients = min(c.kv_clients, self.slots)
        overload = wl.overload(trace, 2 * budget.num_blocks * budget.block_size)
        shared = lambda seed: wl.staggered(wl.shared_prefix(  # noqa: E731
            c.kv_prefix_clients, c.kv_prefix_len, c.suffix_len_dist, c.prefix_output_len, self.vocab, c.seed, seed),
            c.kv_stagger_s)
        wl.check_fits(shared([0]), spec.max_seq_len, "kv shared prefix")
        no_cache = dataclasses.replace(llm.blocks, prefix_caching=False)
        mixed, over = f"mixed C={clients}, budget {c.kv_rows} rows", f"2x overload ({len(overload)} requests)"
        serve = lambda r, n, **o: lambda s: inflight(llm, r(s), n, **opts, **o)  # noqa: E731
        return [Task("kv", mixed, SLOTS, serve(reqs(trace), clients, blocks=budget, max_running=c.kv_rows)),
                Task("kv", mixed, BLOCKS, serve(reqs(trace), clients, blocks=budget)),
                Task("kv", over, BLOCKS, serve(reqs(overload), min(len(overload), self.slots), blocks=budget)),
                Task("kv", f"shared prefix {c.kv_prefix_len}", CACHE_ON, serve(shared, None)),
                Task("kv", f"shared prefix {c.kv_prefix_len}", CACHE_OFF, serve(shared, None, blocks=no_cache)),
                Task("kv", "no shared prefix", CACHE_ON, serve(reqs(trace), clients)),
                Task("kv", "no shared prefix", CACHE_OFF, serve(reqs(trace), clients, blocks=no_cache))]


def _medians(collected: dict) -> dict:
    results: dict = {}
    for (workload, point, mode), runs in collected.items():
        results.setdefault(workload, {}).setdefault(point, {})[mode] = median_of_runs(runs)
    return results
