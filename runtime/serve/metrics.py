"""engine-serve's Prometheus metrics, on a CollectorRegistry of the app's own: request counts by
status, prompt and generated tokens, TTFT and TPOT histograms, speculative drafts and acceptances,
and, read from each executor at scrape time, running and waiting requests, KV slots and blocks in use,
KV waste, preemptions and prefix-cache hits."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from runtime.engine import LLM
from runtime.batching.executor import Completion

# metric name, the executor.stats() key read at scrape time, its kind and help
STATS_METRICS = (
    ("engine_kv_blocks_total", "kv_blocks_total", GaugeMetricFamily, "KV blocks the memory budget holds"),
    ("engine_kv_blocks_used", "kv_blocks_used", GaugeMetricFamily,
     "KV blocks in use: running sequences' and cached prefixes'"),
    ("engine_kv_waste_ratio", "kv_waste_ratio", GaugeMetricFamily,
     "Share of running sequences' KV blocks that no live token fills (last step)"),
    ("engine_preemptions_total", "preemptions", CounterMetricFamily,
     "Sequences preempted to free KV blocks (recomputed later)"),
    ("engine_recomputed_tokens_total", "recomputed_tokens", CounterMetricFamily,
     "Tokens prefilled again after a preemption"),
    ("engine_prefix_cache_hit_tokens_total", "prefix_cache_hit_tokens", CounterMetricFamily,
     "Prompt tokens whose KV was found in the prefix cache"),
    ("engine_prefix_cache_queries_tokens_total", "prefix_cache_queries_tokens", CounterMetricFamily,
     "Prompt tokens looked up in the prefix cache"),
    ("engine_steps_run_ahead_total", "steps_run_ahead", CounterMetricFamily,
     "Decode steps the engine ran straight after the last one, fed its tokens (ExecutorConfig.lookahead)"),
)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ExecutorCollector:
    """Gauges read from every engine's executor.stats() when /metrics is scraped."""

    def __init__(self, engines: dict[str, LLM]):
        self.engines = engines

    def collect(self):
        running = GaugeMetricFamily("engine_requests_running", "Requests holding a KV slot", labels=["model"])
        waiting = GaugeMetricFamily("engine_requests_waiting", "Requests queued for a KV slot", labels=["model"])
        used = GaugeMetricFamily("engine_kv_slots_used", "KV cache slots in use", labels=["model"])
        total = GaugeMetricFamily("engine_kv_slots_total", "KV cache slots of the loaded engine", labels=["model"])
        kv = {key: kind(metric, text, labels=["model"]) for metric, key, kind, text in STATS_METRICS}
        for name, llm in self.engines.items():
            stats, slots = llm.executor.stats(), llm.spec.slots
            running.add_metric([name], stats["running"])
            waiting.add_metric([name], stats["queue_depth"])
            used.add_metric([name], slots - stats["free_slots"])
            total.add_metric([name], slots)
            for key, family in kv.items():
                family.add_metric([name], stats[key])
        yield from (running, waiting, used, total, *kv.values())


class ServerMetrics:
    """The app's metrics; `finished` records one ended request, `rejected` one refused before any work."""

    def __init__(self, engines: dict[str, LLM]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("engine_requests", "Requests by final status "
                                "(stop, length, cancelled, error, rejected)", ["model", "status"], registry=r)
        self.prompt_tokens = Counter("engine_prompt_tokens", "Prompt tokens of served requests", ["model"], registry=r)
        self.generated_tokens = Counter("engine_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("engine_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("engine_time_per_output_token_seconds", "Time per output token after the first",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.drafted = Counter("engine_spec_drafted_tokens", "Speculative draft tokens proposed", ["model"], registry=r)
        self.accepted = Counter("engine_spec_accepted_tokens", "Speculative draft tokens accepted", ["model"],
                                registry=r)
        r.register(ExecutorCollector(engines))

    def finished(self, model: str, completion: Completion) -> None:
        m = completion.metrics or {}
        self.requests.labels(model, completion.finish_reason).inc()
        self.prompt_tokens.labels(model).inc(completion.prompt_tokens)
        self.generated_tokens.labels(model).inc(len(completion.token_ids))
        if m.get("ttft_s") is not None:
            self.ttft.labels(model).observe(m["ttft_s"])
        if m.get("tpot_s") is not None:
            self.tpot.labels(model).observe(m["tpot_s"])
        if m.get("speculation"):
            self.drafted.labels(model).inc(m["speculation"]["drafted"])
            self.accepted.labels(model).inc(m["speculation"]["accepted"])

    def rejected(self, model: str) -> None:
        self.requests.labels(model, "rejected").inc()

    def render(self) -> bytes:
        """The exposition text (reads executor stats: call it off the event loop)."""
        return generate_latest(self.registry)
