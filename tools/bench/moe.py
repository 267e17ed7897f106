"""Parameter counts of a mixture-of-experts checkpoint for the decode benchmark: every stored weight, and
the ones one token reads (attention, norms, router, the lm_head, and k of the E experts of each sparse
layer; the embedding table counts one row), so decode bytes per token ~ active x bytes per weight."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open


def parameter_counts(checkpoint: str | Path) -> dict[str, int]:
    """{"total", "active_per_token"} for a checkpoint (dense: both equal but for the embedding rows)."""
    path = Path(checkpoint)
    config = json.loads((path / "config.json").read_text())
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    chosen = config.get("num_experts_per_tok", 0)
    total = active = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                size = 1
                for d in shape:
                    size *= d
                total += size
                if "embed_tokens" in name:
                    active += shape[-1]
                elif ".experts." in name and experts:
                    active += size * chosen // experts
                else:
                    active += size
    return {"total": total, "active_per_token": active}
