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


def expert_load(checkpoint: str | Path, batch_sizes: tuple[int, ...], positions: int = 16, seed: int = 0) -> list[dict]:
    """Expert-load figures behind batch-B decode throughput, from transformers' own routers on random tokens:
    B random rows of `positions` tokens go through the model once; the B tokens at one position stand for one
    decode step's batch. Per batch size: distinct experts a step reads per sparse layer (mean; 1 row reads k),
    so expert bytes read per step relative to batch 1, and the busiest expert's tokens over the mean of the
    used ones (imbalance)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    routers = [m for name, m in model.named_modules() if name.endswith(("mlp.gate", "mlp.router"))
               and hasattr(m, "top_k")]
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[-1])) for r in routers]
    rng = np.random.default_rng(seed)
    rows = max(batch_sizes)
    ids = torch.from_numpy(rng.integers(4, model.config.vocab_size, (rows, positions)))
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    k = routers[0].top_k
    out = []
    for batch in batch_sizes:
        distinct, imbalance = [], []
        for indices in chosen:  # [rows * positions, k] per sparse layer
            steps = indices.reshape(rows, positions, k)[:batch]
            for t in range(positions):
                counts = np.bincount(steps[:, t].reshape(-1).numpy())
                used = counts[counts > 0]
                distinct.append(len(used))
                imbalance.append(used.max() / used.mean())
        out.append({"batch": batch, "distinct_experts_per_layer": float(np.mean(distinct)),
                    "expert_bytes_vs_batch_1": float(np.mean(distinct)) / k,
                    "busiest_over_mean_load": float(np.mean(imbalance))})
    return out


if __name__ == "__main__":
    import sys

    for row in expert_load(sys.argv[1], tuple(int(b) for b in sys.argv[2].split(","))):
        print(row)
