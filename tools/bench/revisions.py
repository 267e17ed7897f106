"""Decode tok/s of the same engine under two revisions of the runtime, in one run: does a change keep
the runtime's speed? Or under one revision with two KV cache backends (`--new-kv-backend`: what the device
path costs on a CPU):

    python -m tools.bench.revisions --engine engines/tiny-llama --old 4d2e932 --new WORKTREE --batch-sizes 1,8
    python -m tools.bench.revisions --engine engines/tiny-llama --old . --new . --new-kv-backend ortvalue

A revision is a git commit (extracted with `git archive` into a temporary directory) or a directory
holding a checkout (`--new .` = this working tree). Every measurement runs in a fresh Python process
whose PYTHONPATH is that revision's tree, so each imports only its own `runtime/`; the revisions
alternate round by round (A B B A ...), each round loads the engine, warms up once per batch size and
then times `--runs` generations per batch size. Decode tok/s as in tools/bench/decode.py:
batch * (new_tokens - 1) / (end of generation - the moment every row has its first token). The figure
is the median over all runs of a revision, with min and max.

The child side (`--child`) imports nothing from tools/: only the revision's runtime, numpy and the
standard library, so an old revision without this file can be measured."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def measure_child(engine: str, batch_sizes: list[int], prompt_len: int, new_tokens: int, runs: int,
                  threads: int, seed: int, kv_backend: str | None = None) -> dict[str, list[float]]:
    """In the revision's process: decode tok/s of each timed run, per batch size (`kv_backend`: the KV cache's,
    default the device's)."""
    import numpy as np

    from runtime.engine import LLM
    # by file: the revision's tree comes first on sys.path, and its tools/ may predate measure.py
    spec = importlib.util.spec_from_file_location("bench_measure", Path(__file__).with_name("measure.py"))
    measure = sys.modules["bench_measure"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(measure)
    decode_tok_s, synthetic_prompts, timed_generate = measure.decode_tok_s, measure.synthetic_prompts, measure.timed_generate

    max_seq_len = prompt_len + new_tokens
    backend = {"kv_backend": kv_backend} if kv_backend else {}  # only when asked: a revision may predate it
    llm = LLM(engine, max_batch_size=max(batch_sizes), max_seq_len=max_seq_len, threads=threads,
              max_tokens_per_step=max(batch_sizes) * prompt_len, min_prefix_reuse=max_seq_len + 1, **backend)
    rng = np.random.default_rng(seed)
    # from the file, not llm.manifest: its form differs between revisions (a dict before the typed manifest)
    vocab = json.loads((Path(engine) / "manifest.json").read_text())["model"]["hyperparameters"]["vocab_size"]
    rates: dict[str, list[float]] = {}
    try:
        for batch in batch_sizes:
            for run in range(runs + 1):  # run 0 warms up
                timing = timed_generate(llm, synthetic_prompts(rng, batch, prompt_len, vocab), new_tokens)
                if run:
                    rates.setdefault(str(batch), []).append(decode_tok_s(batch, new_tokens, timing))
    finally:
        llm.close()
    return rates


def revision_tree(revision: str, repo: Path, scratch: Path) -> Path:
    """A directory holding `revision`'s files: the directory itself, or the commit extracted with git archive."""
    if Path(revision).is_dir():
        return Path(revision).resolve()
    out = scratch / revision.replace("/", "_")
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", revision], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def run_round(tree: Path, args: dict) -> dict[str, list[float]]:
    """One round of measurements in a fresh process that imports `tree`'s runtime."""
    env = os.environ | {"PYTHONPATH": str(tree)}
    # run as -c, not as a script: a script's directory (tools/bench/) would come first on sys.path
    code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    cmd = [sys.executable, "-c", code, str(Path(__file__).resolve()), "--child", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(measure_child(**json.loads(sys.argv[2]))))
        return
    _cli()


def _cli() -> None:
    import click

    from tools.bench import env
    from tools.bench.measure import int_list
    from tools.bench.stats import spread

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("--engine", required=True, type=click.Path(exists=True, file_okay=False))
    @click.option("--old", required=True, help="Commit or checkout directory: the baseline.")
    @click.option("--new", default=".", show_default=True, help="Commit or checkout directory: the change.")
    @click.option("--batch-sizes", default="1,8", show_default=True)
    @click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True)
    @click.option("--new-tokens", type=click.IntRange(min=2), default=64, show_default=True)
    @click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True, help="Timed runs per round.")
    @click.option("--rounds", type=click.IntRange(min=1), default=4, show_default=True, help="Rounds per revision.")
    @click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
    @click.option("--kv-backend", type=click.Choice(["numpy", "ortvalue"]), default=None,
                  help="Both revisions' KV cache backend (default: the device's).")
    @click.option("--new-kv-backend", type=click.Choice(["numpy", "ortvalue"]), default=None,
                  help="The new revision's instead (--old . --new . --new-kv-backend ortvalue compares backends).")
    def command(engine, old, new, batch_sizes, prompt_len, new_tokens, runs, rounds, threads, kv_backend,
                new_kv_backend):
        """Decode tok/s of one engine under two revisions of the runtime, alternating in one run."""
        try:
            sizes = int_list(batch_sizes)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--batch-sizes") from None
        args = {"engine": str(Path(engine).resolve()), "batch_sizes": list(sizes), "prompt_len": prompt_len,
                "new_tokens": new_tokens, "runs": runs, "threads": threads}
        click.echo(f"{env.machine()}; load average before {env.load_average()[0]:.2f}")
        with tempfile.TemporaryDirectory() as scratch:
            trees = {"old": revision_tree(old, Path.cwd(), Path(scratch)),
                     "new": revision_tree(new, Path.cwd(), Path(scratch))}
            rates: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
            paired: dict[str, list[float]] = {}  # per round, new / old: both taken back to back
            for r in range(rounds):
                means = {}
                for label in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    backend = new_kv_backend or kv_backend if label == "new" else kv_backend
                    got = run_round(trees[label], args | {"seed": r, "kv_backend": backend})
                    for batch, values in got.items():
                        rates[label].setdefault(batch, []).extend(values)
                    means[label] = {b: sum(v) / len(v) for b, v in got.items()}
                    click.echo(f"round {r + 1}/{rounds} {label}: " +
                               ", ".join(f"batch {b} {rate:.1f} tok/s" for b, rate in means[label].items()))
                for batch, rate in means["new"].items():
                    paired.setdefault(batch, []).append(rate / means["old"][batch])
        click.echo(f"load average after {env.load_average()[0]:.2f}")
        if kv_backend or new_kv_backend:  # name each side's backend in the table
            old, new = f"{old} [{kv_backend or 'default'}]", f"{new} [{new_kv_backend or kv_backend or 'default'}]"
        click.echo(f"| batch | {old} decode tok/s (median, min-max) | {new} | new / old | new / old, paired rounds "
                   f"(median, min-max) |\n|---|---:|---:|---:|---:|")
        for batch in map(str, sizes):
            a, b, p = spread(rates["old"][batch]), spread(rates["new"][batch]), spread(paired[batch])
            click.echo(f"| {batch} | {a['median']:.1f} ({a['min']:.1f}-{a['max']:.1f}) | "
                       f"{b['median']:.1f} ({b['min']:.1f}-{b['max']:.1f}) | {b['median'] / a['median']:.3f} | "
                       f"{p['median']:.3f} ({p['min']:.3f}-{p['max']:.3f}) |")

    command()


if __name__ == "__main__":
    main()
