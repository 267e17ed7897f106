"""Moving the top decoding sequence down into an empty row (SlotTable.compact) on and off, alternated round by
round over the same requests through engine-bench's in-flight driver: whole-run and full-load tokens/s, TPOT p50,
and decode rows against the rows that decoded (the rest rode along idle).

    python -m tools.bench.compaction ENGINE --clients 16 --rounds 4      # closed loop, 3 requests a client
    python -m tools.bench.compaction ENGINE --rate 2 --rounds 3          # open loop, 32 requests at 2/s"""
from __future__ import annotations

import statistics

import click


def compare(engine: str, rounds: int, clients: int | None, rate: float | None, slots: int = 16,
            prompts: str = "uniform:16:128", outputs: str = "uniform:64:192") -> dict:
    """Per mode ("on", "off") and round: (wall s, whole-run tok/s, full-load tok/s or None, TPOT p50 s, decode rows,
    decoding rows). Lengths drawn as engine-bench draws them (`prompts`, `outputs`)."""
    from runtime.batching import slot_table
    from runtime.engine import LLM
    from tools.engine_bench import workloads as wl
    from tools.engine_bench.config import LengthDist
    from tools.engine_bench.drivers import inflight

    inputs, lengths = LengthDist.parse(prompts), LengthDist.parse(outputs)
    shapes = (wl.stream(32, rate, inputs, lengths, 0) if clients is None else wl.mixed(3 * clients, inputs, lengths, 0))
    compact, off = slot_table.SlotTable.compact, lambda self, *args: 0
    llm = LLM(engine, max_batch_size=slots)
    try:
        wl.check_fits(shapes, llm.max_seq_len, "compaction")
        inflight(llm, wl.materialize(shapes[:slots], llm.manifest.vocab_size, [0, 99]), clients)  # warm
        out: dict = {"on": [], "off": []}
        for i in range(rounds):
            reqs = wl.materialize(shapes, llm.manifest.vocab_size, [0, i])
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                slot_table.SlotTable.compact = compact if mode == "on" else off
                m = inflight(llm, reqs, clients)
                tokens = sum(s.output_tokens for s in m.served)
                out[mode].append((m.wall_s, tokens / m.wall_s, m.full_load[1] / m.full_load[0] if m.full_load else None,
                                  statistics.median(s.tpot_s for s in m.served), m.breakdown["decode_rows"],
                                  m.breakdown["decode_active_rows"]))
        return out
    finally:
        slot_table.SlotTable.compact = compact
        llm.close()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.option("--rounds", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--clients", type=click.IntRange(min=1), default=16, show_default=True,
              help="Closed loop with this many clients (3 requests each); ignored with --rate.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Open loop instead: 32 requests arriving at this many per second.")
def main(engine: str, rounds: int, clients: int, rate: float | None) -> None:
    """Compaction on against off, same requests, alternating."""
    out = compare(engine, rounds, None if rate else clients, rate)
    for mode, runs in out.items():
        full = [f"{r[2]:.1f}" for r in runs if r[2] is not None]
        click.echo(f"{mode:3s} whole tok/s {[round(r[1], 1) for r in runs]}"
                   + (f" full-load tok/s {full}" if full else "")
                   + f" TPOT p50 ms {[round(r[3] * 1e3, 2) for r in runs]} decode rows/decoding {[f'{r[4]}/{r[5]}' for r in runs]}")
    click.echo("whole-run on/off per round " + ", ".join(f"{a[1] / b[1]:.3f}" for a, b in zip(out["on"], out["off"]))
               + "; TPOT on/off " + ", ".join(f"{a[3] / b[3]:.3f}" for a, b in zip(out["on"], out["off"])))


if __name__ == "__main__":
    main()
