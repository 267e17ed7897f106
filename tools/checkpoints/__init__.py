"""Checkpoints made offline for tests, demos and benchmarks: small random ones, a large streamed one, the trained pair."""
