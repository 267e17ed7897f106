"""Engines side by side by the process CPU time of one step: a decode step at batch 1 and at batch 8 and a
256-token prefill, through the runtime's ModelRunner with one thread, each engine in `--processes` processes of its
own (tools/bench/isolated.py), every process measured every round in alternating order. One thread and CPU time
hold up on a machine other work shares; processes of one engine still differ by up to ~10% (where their memory
lands), so each engine gets several and the median is over all of them.

    python -m tools.bench.step_cpu_time --engine base=ENGINE --engine other=ENGINE2 [--rounds 5] [--processes 3]

A NAME=DIR|key=value;key=value engine sets ONNX Runtime session config entries (e.g.
`session.set_denormal_as_zero=1`). Prints ms per step, the median over processes and each process's median."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import numpy as np

from tools.bench import isolated

PAST, PREFILL = 200, 256


class Stepper:
    """One engine in its worker process: ModelRunner on one thread, the session config entries given."""

    def __init__(self, spec: str):
        import runtime.model.model_runner as model_runner
        from runtime.config import LoadConfig
        from runtime.manifest.load import read_manifest

        engine, _, extra = spec.partition("|")
        plain = model_runner.session_options

        def configured(*args, **kwargs):
            options = plain(*args, **kwargs)
            for entry in filter(None, extra.split(";")):
                options.add_session_config_entry(*entry.split("=", 1))
            return options

        model_runner.session_options = configured
        manifest = read_manifest(Path(engine))
        self.runner = model_runner.ModelRunner(Path(engine), manifest, manifest.kv_cache.resized(8, 2 * PREFILL),
                                               LoadConfig(device="cpu", threads=1))
        self.ids = np.random.default_rng(0).integers(10, 1000, (8, PREFILL))
        self.measure(1)  # warm-up: every call shape once

    def _decode(self, rows: int) -> None:
        self.runner.run(0, self.ids[:rows, :1], np.full(rows, PAST, np.int32), PAST + 1, np.arange(rows),
                        head="next_token")

    def _prefill(self) -> None:
        self.runner.run(0, self.ids[:1], np.array([PREFILL - 1], np.int32), PREFILL, np.array([PREFILL - 1]),
                        head="next_token")

    def measure(self, reps: int = 10) -> dict[str, float]:
        """Median seconds of process CPU time per call: decode batch 1 (`reps` calls), batch 8, one prefill."""
        out = {}
        for key, call, n in (("b1", lambda: self._decode(1), reps), ("b8", lambda: self._decode(8), max(reps // 3, 1)),
                             (f"prefill{PREFILL}", self._prefill, 1)):
            times = []
            for _ in range(n):
                start = time.process_time()
                call()
                times.append(time.process_time() - start)
            out[key] = statistics.median(times)
        return out

    def close(self) -> None:
        pass


@click.command()
@click.option("--engine", "engines", multiple=True, required=True, help="NAME=ENGINE_DIR[|key=value;...]")
@click.option("--rounds", default=5, show_default=True)
@click.option("--processes", default=3, show_default=True, help="Processes per engine.")
def main(engines: tuple[str, ...], rounds: int, processes: int) -> None:
    named = dict(e.split("=", 1) for e in engines)
    workers = {(name, i): isolated.Worker(Stepper, spec) for i in range(processes) for name, spec in named.items()}
    runs: dict[tuple, list[dict]] = {key: [] for key in workers}
    load_before = open("/proc/loadavg").read().split()[:3]
    try:
        order = list(workers)
        for _ in range(rounds):
            for key in order:
                runs[key].append(workers[key].call("measure"))
            order.reverse()
    finally:
        for w in workers.values():
            w.close()
    load_after = open("/proc/loadavg").read().split()[:3]
    click.echo(f"load average before {' '.join(load_before)}, after {' '.join(load_after)}")
    for name in named:
        mine = [rs for (n, _), rs in runs.items() if n == name]
        cells = []
        for k in mine[0][0]:
            per = [statistics.median(r[k] for r in rs) * 1e3 for rs in mine]
            cells.append(f"{k} {statistics.median(r[k] * 1e3 for rs in mine for r in rs):.2f} ms "
                         f"(processes {' '.join(f'{p:.2f}' for p in per)})")
        click.echo(f"{name:16s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
