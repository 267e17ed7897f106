"""engine-serve: the OpenAI-compatible HTTP server, its request/response protocol and its Prometheus metrics."""
