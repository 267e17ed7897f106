"""Greedy decode tok/s at batch 1 and 8 of one engine on the runtime on PYTHONPATH (median of 5 after a
warm-up, prefill excluded): `python -m tools.bench.kv_backend ENGINE [numpy|ortvalue]`. Run it with
PYTHONPATH pointing at two checkouts, alternately, to compare runtimes on the same engine."""
from __future__ import annotations

import click

from runtime.engine import LLM
from tools.bench.measure import median_decode_tok_s


@click.command()
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.argument("kv_backend", type=click.Choice(["numpy", "ortvalue"]), required=False)
def main(engine: str, kv_backend: str | None = None) -> None:
    """Decode tok/s of ENGINE at batch 1 and 8 with the KV backend KV_BACKEND (default: the device's)."""
    llm = LLM(engine, max_batch_size=8, **({"kv_backend": kv_backend} if kv_backend else {}))
    for batch in (1, 8):
        prompts = [[3 + (i * 7 + j) % 200 for j in range(16)] for i in range(batch)]
        print(f"batch {batch}: {median_decode_tok_s(llm, prompts, 64, runs=5):.0f} tok/s")
    llm.close()


if __name__ == "__main__":
    main()
