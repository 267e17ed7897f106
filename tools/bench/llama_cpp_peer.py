"""Our engine against llama.cpp on the same GGUF file, on this CPU: greedy decode tok/s at batch 1 and batch 8,
and prefill tok/s of a 512-token prompt, both with the same thread count, rounds alternated (ours, llama.cpp,
ours, ...) and the median of each reported with the ratio.

    python -m tools.bench.llama_cpp_peer --gguf checkpoints/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --engine engines/smollm2 [--threads 2] [--rounds 5] [--new-tokens 64] [--out FILE.json]

llama-cpp-python is the peer, built natively (a source build, never in CI; tools/bench/gguf_peer.py says how).
Batch 8 on llama.cpp is 8 sequences in one llama_batch per step (its own parallel decoding, as
`llama-batched-bench` runs it), the pick an argmax over each sequence's logits, like ours. Prompts are random
token ids (the same ids for both), so neither side's tokenizer is timed."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import numpy as np

from tools.bench.gguf_peer import INSTALL_HINT, load


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab, 30000), (batch, length)).tolist()


# -- llama.cpp ---------------------------------------------------------------------------------------------
class LlamaCpp:
    """One llama.cpp context of `seqs` sequences; decode steps as one llama_batch of a token per sequence."""

    def __init__(self, gguf: Path, threads: int, seqs: int, n_ctx: int):
        import llama_cpp

        self.lib, self.seqs = llama_cpp, seqs
        self.llm = load(gguf, n_ctx * seqs, threads, n_seq_max=seqs)
        self.vocab = self.llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(max(n_ctx, seqs), 0, seqs)

    def _fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.lib.llama_decode(self.llm.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        row = self.lib.llama_get_logits_ith(self.llm.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(self.vocab,))))

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.llm.ctx), True)

    def prefill_seconds(self, prompt: list[int]) -> float:
        self._clear()
        start = time.perf_counter()
        self._fill([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        self._argmax(len(prompt) - 1)
        return time.perf_counter() - start

    def decode_tok_s(self, batch: list[list[int]], new_tokens: int) -> float:
        """Greedy tokens/s of the decode steps (each prompt prefilled first, untimed)."""
        self._clear()
        last = []
        for s, prompt in enumerate(batch):
            self._fill([(t, p, s, p == len(prompt) - 1) for p, t in enumerate(prompt)])
            last.append(self._argmax(len(prompt) - 1))
        pos = [len(p) for p in batch]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            self._fill([(last[s], pos[s], s, True) for s in range(len(batch))])
            last = [self._argmax(s) for s in range(len(batch))]
            pos = [p + 1 for p in pos]
        return len(batch) * (new_tokens - 1) / (time.perf_counter() - start)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.llm.close()


# -- ours ------------------------------------------------------------------------------------------------
class Ours:
    def __init__(self, engine: Path, threads: int):
        from runtime import LLM

        self.llm = LLM(engine, threads=threads)

    def prefill_seconds(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.llm.runner.prefill(0, [prompt])
        return time.perf_counter() - start

    def decode_tok_s(self, batch: list[list[int]], new_tokens: int) -> float:
        from tools.bench.measure import decode_tok_s, timed_generate

        return decode_tok_s(len(batch), new_tokens, timed_generate(self.llm, batch, new_tokens))

    def close(self) -> None:
        self.llm.close()


def measure(side, rounds_done: dict, name: str, new_tokens: int, vocab: int, prompt_len: int) -> None:
    for batch in (1, 8):
        rounds_done.setdefault(f"{name} decode batch {batch} tok/s", []).append(
            side.decode_tok_s(prompts(batch, 32, vocab, seed=batch), new_tokens))
    long = prompts(1, prompt_len, vocab, seed=99)[0]
    rounds_done.setdefault(f"{name} prefill {prompt_len} tok/s", []).append(prompt_len / side.prefill_seconds(long))


@click.command()
@click.option("--gguf", "gguf", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--engine", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--threads", default=2, show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--prompt-len", default=512, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(gguf: Path, engine: Path, threads: int, rounds: int, new_tokens: int, prompt_len: int,
         out: Path | None) -> None:
    """Alternate rounds of ours and llama.cpp (one warm-up round each, untimed), then the medians and ratios."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise click.ClickException(f"llama-cpp-python {INSTALL_HINT}")
    ours, peer = Ours(engine, threads), LlamaCpp(gguf, threads, 8, 32 + new_tokens + prompt_len)
    vocab = peer.vocab
    samples: dict[str, list[float]] = {}
    try:
        for side in (ours, peer):  # warm-up: call shapes bound, caches touched
            measure(side, {}, "warm", new_tokens, vocab, prompt_len)
        for r in range(rounds):
            for name, side in (("ours", ours), ("llama.cpp", peer)):
                measure(side, samples, name, new_tokens, vocab, prompt_len)
            click.echo(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()),
                       err=True)
    finally:
        ours.close()
        peer.close()
    medians = {k: statistics.median(v) for k, v in samples.items()}
    for metric in ("decode batch 1 tok/s", "decode batch 8 tok/s", f"prefill {prompt_len} tok/s"):
        a, b = medians[f"ours {metric}"], medians[f"llama.cpp {metric}"]
        click.echo(f"{metric:22s} ours {a:8.1f}  llama.cpp {b:8.1f}  ratio {a / b:.2f}x")
    if out:
        out.write_text(json.dumps({"gguf": str(gguf), "engine": str(engine), "threads": threads, "rounds": rounds,
                                   "new_tokens": new_tokens, "samples": samples, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
