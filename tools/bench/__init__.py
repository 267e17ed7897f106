"""Every benchmark of the project, and the pieces they share.

Shared: measure (greedy decode tok/s of an engine, the one way every harness times it; synthetic prompts;
int_list), env (CPU model with AVX2/AVX-512, cores, load, library versions), stats (median/min/max of runs,
percentiles), isolated (a backend or a build in its own process), docs (a benchmark's docs section).
Harnesses: decode (our engines against transformers and onnxruntime-genai), quantized_head and gguf_peer
(int4 against llama.cpp), revisions (one engine under two revisions of the runtime, or two KV backends), tp_decode,
soak (engine-serve under load), moe / moe_peer (mixture of experts, beside
llama.cpp), step_breakdown (the step around the model call), kv_overhead and kv_int8_decode (KV memory),
desc_act (GPTQ act-order lowering), read_bandwidth (the machine's read bandwidth through ONNX Runtime, the
yardstick for a bandwidth-bound decode). engine-bench has its own package,
tools/engine_bench/, built on these (its --compaction off measures what moving rows down buys); the
executor-only runs use tools/fake_runner.py; the lent GPU's check is tools/gpu/. Figures: docs/BENCHMARKS.md."""
