"""engine-bench's summary of one measurement: throughput, TTFT/TPOT/latency percentiles (tools/bench/stats.py)."""
from __future__ import annotations

import hashlib

from tools.engine_bench.drivers import Measurement
from tools.bench.stats import percentiles


def summarize(m: Measurement) -> dict:
    """Generated tokens/s over the wall time of the measurement, and per-request percentiles."""
    out_tokens = sum(s.output_tokens for s in m.served)
    decoded = [s for s in m.served if s.output_tokens > 1 and s.tpot_s is not None]
    decode_s = sum(s.tpot_s * (s.output_tokens - 1) for s in decoded)
    drafted = sum(s.drafted for s in m.served)
    return {
        "requests": len(m.served),
        "prompt_tokens": sum(s.prompt_tokens for s in m.served),
        "output_tokens": out_tokens,
        "reused_prompt_tokens": sum(s.reused_tokens for s in m.served),
        "wall_s": m.wall_s,
        "throughput_tok_s": out_tokens / m.wall_s if m.wall_s > 0 else 0.0,
        # closed loop: while every client had a request in flight (the run's end drains at falling concurrency)
        "full_load_tok_s": m.full_load[1] / m.full_load[0] if m.full_load and m.full_load[0] > 0 else None,
        # per request, after its first token: tokens / time, pooled over requests (speculation's speedup)
        "decode_tok_s": sum(s.output_tokens - 1 for s in decoded) / decode_s if decode_s > 0 else None,
        "drafted": drafted,
        "acceptance_rate": sum(s.accepted for s in m.served) / drafted if drafted else None,
        "outputs_digest": hashlib.sha256("".join(sorted(s.digest for s in m.served)).encode()).hexdigest()[:16],
        "ttft_s": percentiles([s.ttft_s for s in m.served]),
        "tpot_s": percentiles([s.tpot_s for s in m.served]),
        "latency_s": percentiles([s.latency_s for s in m.served]),
        "breakdown": m.breakdown,
    }
