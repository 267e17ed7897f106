"""Every benchmark of the project, and the pieces they share.

Shared: env (CPU model with AVX2/AVX-512, cores, load, library versions), stats (median/min/max of runs,
percentiles), isolated (a backend or a build in its own process), report.replace_section (a docs section),
config.int_list (comma-separated sizes). Benchmarks: decode (`python -m tools.bench.decode`: decode tok/s
of our engines against transformers and onnxruntime-genai), engine-bench (tools/engine_bench.py over
config, workloads, drivers, metrics, suite and report: in-flight against static batching, speculation),
revisions (one engine under two revisions of the runtime). Figures: docs/BENCHMARKS.md."""
