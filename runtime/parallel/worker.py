"""The worker ranks (1..N-1) of a tensor-parallel engine: load the rank's segments, then run each step
rank 0 broadcasts (a Step: token ids, lengths, KV prefix copies) until it broadcasts a stop."""
from __future__ import annotations

import datetime
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from runtime.config import LoadConfig
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import read_manifest
from runtime.parallel.rank import TIMEOUT_S, RankEngine, rank_group
from runtime.parallel.step import receive

IDLE = datetime.timedelta(days=365)  # workers wait this long for rank 0's next step


def _worker(engine_dir: str, rank: int, size: int, port: int, spec: dict, config: LoadConfig) -> None:
    """A spawned rank: load its segments, tell rank 0 it is ready, then serve steps until STOP."""
    try:
        engine_dir = Path(engine_dir)
        manifest = read_manifest(engine_dir, check_files=False)
        store = dist.TCPStore("127.0.0.1", port, size, False, datetime.timedelta(seconds=TIMEOUT_S))
        engine = RankEngine(engine_dir, manifest, KVCacheSpec.from_dict(spec), rank, None, config)
        store.set(f"ready/{rank}", "1")
        engine.group = rank_group(rank, size, store, config.device)
        serve(engine)
    except RuntimeError as err:  # rank 0 died or a collective failed: leave, do not hang
        print(f"engine-tp rank {rank}: stopping: {err}", file=sys.stderr)
        sys.exit(1)


def serve(engine: RankEngine) -> None:
    """A worker rank's loop: receive a step from rank 0 (runtime/parallel/step.py), apply its KV copies, run
    the segments."""
    while not (step := receive(engine.broadcast, IDLE)).stop:
        for source, slot, length in step.copies:
            engine.copy_prefix(source, slot, length)
        engine.step(step.start, step.ids, step.seqlens, step.total_len, np.zeros(0, np.int64))
    engine.save_trace()


if __name__ == "__main__":  # started by TensorParallelRunner: ENGINE_DIR RANK SIZE PORT SPEC_JSON LOAD_CONFIG_JSON
    import json

    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]),
            LoadConfig.from_json(sys.argv[6]))
