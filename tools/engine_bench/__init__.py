"""engine-bench: in-flight batching against static batching, one stream and transformers, and speculative decoding
against none, on workloads drawn from a seed (cli.py is the command; config, workloads, drivers, suite, metrics, report)."""
