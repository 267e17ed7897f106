"""engine-bench internals: config, workloads, drivers (in-flight, static, transformers), metrics,
the measurement suite and the report."""
