"""Our engine built from a GGUF file against llama.cpp on the same file: decode tok/s at batch 1 and batch 8
and prefill tok/s of one 512-token prompt, the same threads each, alternated round by round.

    python -m tools.bench.llama_cpp_peer --gguf checkpoints/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --engine engines/smollm2 [--rounds 5] [--threads 2] [--new-tokens 64] [--out results.json]

Ours runs through the runtime's public path (`LLM` + executor, tools/bench/measure.py); llama.cpp through
llama-cpp-python's low-level API (`llama_decode` on a `llama_batch`, one sequence id per row, so batch 8 is
eight parallel sequences in one decode call per step, llama.cpp's own in-flight batching), greedy by argmax
over its logits. Both take the same token ids: rows of the prose of pydoc_data/topics.py, tokenized by the
engine's tokenizer (llama.cpp-exact). Decode tok/s = batch * (new_tokens - 1) / (end - the moment every row
has its first token); prefill tok/s = prompt tokens / (time to the first token). Each side lives in its own
process (tools/bench/isolated.py) and is warmed up once; the order alternates every round; medians with
min and max are printed, the CPU (AVX2 / AVX-512) and the load average beside them.

llama-cpp-python is the `peer` extra, a native source build (pyproject.toml)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click
import numpy as np

from tools.bench import env, isolated
from tools.bench.gguf_perplexity import windows
from tools.bench.measure import Timing, decode_tok_s, timed_generate
from tools.bench.stats import spread


class OursBackend:
    """Our engine through `runtime.engine.LLM`, sized for the largest batch and the prefill prompt."""

    def __init__(self, engine: Path, max_batch: int, max_seq_len: int, threads: int):
        from runtime.engine import LLM

        self.llm = LLM(engine, max_batch_size=max_batch, max_seq_len=max_seq_len, threads=threads,
                       max_tokens_per_step=max_batch * max_seq_len, min_prefix_reuse=max_seq_len + 1)

    def generate(self, prompts: np.ndarray, new_tokens: int) -> Timing:
        return timed_generate(self.llm, prompts, new_tokens)

    def close(self) -> None:
        self.llm.close()


class LlamaCppBackend:
    """llama.cpp on the GGUF file: one context of `max_batch` sequences of `max_seq_len` positions each,
    every row its own sequence id; a generation clears the KV cache, prefills every row in one decode call,
    then decodes one token per row per call."""

    def __init__(self, gguf: Path, max_batch: int, max_seq_len: int, threads: int):
        try:
            import llama_cpp
        except ImportError:
            raise RuntimeError("llama-cpp-python is not installed: pip install -e '.[peer]' (a native build)") from None
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp logs every load to stderr otherwise
        self.lib = lib = llama_cpp
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max = max_batch * max_seq_len, max_batch
        params.n_batch = params.n_ubatch = max_batch * max_seq_len
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        self.batch = lib.llama_batch_init(params.n_batch, 0, 1)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def _decode(self, rows: list[list[int]], start: int, logits_last: bool = True) -> list[int]:
        """Evaluate rows[i] at positions start.. of sequence i; the argmax after each row's last token."""
        lib, batch = self.lib, self.batch
        n = 0
        for seq, row in enumerate(rows):
            for j, token in enumerate(row):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, start + j, 1
                batch.seq_id[n][0], batch.logits[n] = seq, logits_last and j == len(row) - 1
                n += 1
        batch.n_tokens = n
        if (code := lib.llama_decode(self.ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {code}")
        picks, last = [], -1
        for row in rows:
            last += len(row)
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, last), shape=(self.n_vocab,))
            picks.append(int(np.argmax(logits)))
        return picks

    def generate(self, prompts: np.ndarray, new_tokens: int) -> Timing:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        rows = prompts.tolist()
        start = time.perf_counter()
        out = [[t] for t in self._decode(rows, 0)]
        first = time.perf_counter()
        for step in range(1, new_tokens):
            for row, pick in zip(out, self._decode([r[-1:] for r in out], prompts.shape[1] + step - 1)):
                row.append(pick)
        return Timing(first - start, time.perf_counter() - start, out)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def measure(backend, data: np.ndarray, batches: tuple[int, ...], prompt_len: int, prefill_len: int,
            new_tokens: int) -> dict[str, float]:
    """One round on one backend: decode tok/s per batch size, prefill tok/s of one prefill_len prompt."""
    result = {}
    for b in batches:
        t = backend.generate(data[:b, :prompt_len], new_tokens)
        result[f"decode_b{b}"] = decode_tok_s(b, new_tokens, t)
    t = backend.generate(data[:1, :prefill_len], 1)
    result[f"prefill_{prefill_len}"] = prefill_len / t.first_token_s
    return result


class _Measured:
    """A backend object in its worker, with `measure` and a greedy-token check next to it."""

    def __init__(self, factory, *args):
        self.backend = factory(*args)

    def measure(self, *args) -> dict[str, float]:
        return measure(self.backend, *args)

    def tokens(self, prompts: np.ndarray, new_tokens: int) -> list[list[int]]:
        return self.backend.generate(prompts, new_tokens).token_ids

    def close(self) -> None:
        self.backend.close()


@click.command()
@click.option("--gguf", "gguf", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--engine", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Our engine built from the same GGUF (e.g. build_recipes/smollm2_cpu.yaml).")
@click.option("--rounds", default=5, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--batch-sizes", default="1,8", show_default=True)
@click.option("--prompt-len", default=32, show_default=True, help="Prompt tokens per row for decode.")
@click.option("--prefill-len", default=512, show_default=True)
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(gguf: Path, engine: Path, rounds: int, threads: int, batch_sizes: str, prompt_len: int,
         prefill_len: int, new_tokens: int, out: Path | None) -> None:
    """Alternate ours and llama.cpp for `rounds` rounds; print medians (min-max) and the ratio ours / llama.cpp."""
    from tools.bench.measure import int_list

    load_before = env.load_average()  # and after, in the report's environment
    batches = int_list(batch_sizes)
    max_batch, max_seq = max(batches), max(prefill_len, prompt_len + new_tokens) + 1
    data = windows(engine / "tokenizer.json", max_batch * max_seq, max_seq)  # real text rows
    if len(data) < max_batch:
        raise click.UsageError(f"the text gives {len(data)} rows of {max_seq} tokens, batch {max_batch} needs more")
    workers = {"ours": isolated.Worker(_Measured, OursBackend, engine, max_batch, max_seq, threads),
               "llama.cpp": isolated.Worker(_Measured, LlamaCppBackend, gguf, max_batch, max_seq, threads)}
    args = (data, batches, prompt_len, prefill_len, new_tokens)
    try:
        check = {name: w.call("tokens", data[:1, :prompt_len], 16) for name, w in workers.items()}
        same = sum(a == b for a, b in zip(check["ours"][0], check["llama.cpp"][0]))
        click.echo(f"greedy check, 16 tokens of one prompt: {same}/16 identical", err=True)
        for w in workers.values():
            w.call("measure", *args[:-1], 4)  # warm-up: every call shape once, a few tokens
        runs: dict[str, list[dict]] = {name: [] for name in workers}
        for r in range(rounds):
            for name in (list(workers) if r % 2 == 0 else list(workers)[::-1]):
                runs[name].append(workers[name].call("measure", *args))
            click.echo(f"round {r + 1}/{rounds}: " + "; ".join(
                f"{n} " + ", ".join(f"{k} {v:.1f}" for k, v in runs[n][-1].items()) for n in workers), err=True)
    finally:
        for w in workers.values():
            w.close()
    keys = list(runs["ours"][0])
    table = {n: {k: spread([run[k] for run in rs]) for k in keys} for n, rs in runs.items()}
    report = {"environment": env.environment(), "load_average_before": load_before, "gguf": str(gguf), "engine": str(engine), "threads": threads,
              "rounds": rounds, "prompt_len": prompt_len, "new_tokens": new_tokens, "greedy_check_identical_of_16": same,
              "llama_cpp": env.module_versions(["llama_cpp"])["llama_cpp"], "results": table}
    click.echo(f"{report['environment']['machine']}; load {load_before} before, "
               f"{report['environment']['load_average']} after")
    for k in keys:
        o, p = table["ours"][k], table["llama.cpp"][k]
        click.echo(f"{k:12s} ours {o['median']:8.1f} ({o['min']:.1f}-{o['max']:.1f})   llama.cpp {p['median']:8.1f} "
                   f"({p['min']:.1f}-{p['max']:.1f})   ours/llama.cpp {o['median'] / p['median']:.2f}x  tok/s")
    if out:
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
