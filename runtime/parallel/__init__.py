"""Tensor parallelism over torch.distributed: rank 0's runner, each rank's engine segments and the worker process."""
