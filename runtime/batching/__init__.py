"""In-flight batching: the executor's step loop, the scheduler and the table of KV rows it owns."""
