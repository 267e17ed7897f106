"""Perplexity of engines built from a GGUF file against transformers' float32 model loaded from the same
file, on real English prose: the documentation topics of `pydoc_data/topics.py` (ships with Python), in
sorted topic order, tokenized with the engine's tokenizer (llama.cpp-exact, builder/gguf/tokenizer.py),
cut into non-overlapping windows of `--window` tokens; each window is scored from its second token on
(the first has no context), like llama.cpp's `llama-perplexity` scores the second half of each window
(that tool is the peer on the same file: `llama-perplexity -m FILE -f topics.txt -c 512`).

    python -m tools.bench.gguf_perplexity --gguf checkpoints/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --engine level4=engines/smollm2 [--engine NAME=DIR ...] [--max-tokens 51200] [--window 512] [--peer]
        [--peer-gguf OTHER.gguf] [--text FILE]

`--peer` adds llama.cpp on the same file (llama-cpp-python, `logits_all`, 2 threads): the same token ids,
scored the same way (all but the first token of each window), so its row compares with ours directly.

Prints one line per model (perplexity, relative change from transformers, top-1 agreement with it; with the peer
each engine's top-1 agreement minus llama.cpp's and its standard error from the windows' paired differences) and
writes the same as JSON with `--out`."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import click
import numpy as np

from tools.accuracy import Stats, log_softmax


def topics_text() -> str:
    """The prose of pydoc_data/topics.py, topics in sorted order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def windows(tokenizer_file: Path, max_tokens: int, window: int, text: str | None = None) -> np.ndarray:
    """[count, window] token ids of the text stream (default the topics' prose), count = min(max_tokens, stream)
    // window."""
    from tokenizers import Tokenizer

    text = topics_text() if text is None else text
    ids = np.array(Tokenizer.from_file(str(tokenizer_file)).encode(text, add_special_tokens=False).ids)
    count = min(max_tokens, len(ids)) // window
    if count < 1:
        raise click.UsageError(f"--max-tokens {max_tokens} / --window {window}: no whole window ({len(ids)} tokens)")
    return ids[:count * window].reshape(count, window)


def engine_model(engine: Path, threads: int | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """ids [window] -> logits [window, vocab] from one prefill of the engine."""
    from runtime.config import LoadConfig
    from runtime.manifest.load import read_manifest
    from runtime.model.model_runner import ModelRunner

    manifest = read_manifest(engine)

    def run(ids: np.ndarray) -> np.ndarray:
        spec = manifest.kv_cache.resized(1, len(ids) + 1)
        runner = run.runner = getattr(run, "runner", None) or ModelRunner(engine, manifest, spec,
                                                                          LoadConfig(device="cpu", threads=threads))
        return runner.run(0, ids[None], np.array([len(ids) - 1]), len(ids), np.arange(len(ids)))
    return run


def transformers_model(gguf: Path) -> Callable[[np.ndarray], np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()

    def run(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(ids[None])).logits[0].numpy()
    return run


def llama_cpp_model(gguf: Path, window: int, threads: int) -> Callable[[np.ndarray], np.ndarray]:
    """ids [window] -> logits [window, vocab] from llama.cpp (llama-cpp-python) on the same GGUF, one
    fresh evaluation per window (KV cache f16, llama.cpp's default; no BOS added: the ids as given)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise click.UsageError("--peer needs llama-cpp-python: pip install -e '.[peer]' (a native source build)") from None
    llm = Llama(str(gguf), n_ctx=window, n_batch=window, n_ubatch=window, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)

    def run(ids: np.ndarray) -> np.ndarray:
        llm.reset()
        llm.eval(ids.tolist())
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    return run


@click.command()
@click.option("--gguf", "gguf", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--engine", "engines", multiple=True, required=True, help="NAME=ENGINE_DIR, repeatable")
@click.option("--max-tokens", default=51200, show_default=True)
@click.option("--window", default=512, show_default=True)
@click.option("--peer", is_flag=True, help="Also score llama.cpp (llama-cpp-python) on the same GGUF.")
@click.option("--peer-gguf", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The file llama.cpp scores (implies --peer; default --gguf): e.g. a q4_0 of the same weights, "
                   "scored against transformers on --gguf.")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Score this UTF-8 text instead of the topics' prose (e.g. code, to see a calibration's domain).")
@click.option("--threads", default=2, show_default=True,
              help="Threads of each model (llama.cpp, our engines, torch): 1 at idle priority on a shared machine, "
                   "where two spinning threads wait on each other.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(gguf: Path, engines: tuple[str, ...], max_tokens: int, window: int, peer: bool, peer_gguf: Path | None,
         text_file: Path | None, threads: int, out: Path | None) -> None:
    """Score every engine and transformers on the same windows, window by window, side by side."""
    named = dict(e.split("=", 1) for e in engines)
    first = Path(next(iter(named.values())))
    data = windows(first / "tokenizer.json", max_tokens, window, text_file.read_text() if text_file else None)
    import torch

    torch.set_num_threads(threads)
    models = {"transformers": transformers_model(gguf), **{n: engine_model(Path(d), threads) for n, d in named.items()}}
    if peer or peer_gguf:
        models["llama.cpp"] = llama_cpp_model(peer_gguf or gguf, window, threads)
    stats, start = {name: Stats() for name in models}, time.perf_counter()
    for i, ids in enumerate(data):
        reference = log_softmax(models["transformers"](ids)[:-1])
        for name, run in models.items():
            logprobs = reference if name == "transformers" else log_softmax(run(ids)[:-1])
            stats[name].add(logprobs, ids[1:], reference)
        click.echo(f"window {i + 1}/{len(data)} ({time.perf_counter() - start:.0f} s): " + ", ".join(
            f"{n} {np.exp(s.nll / s.tokens):.4f}" for n, s in stats.items()), err=True)
        report = {"gguf": str(gguf), "peer_gguf": str(peer_gguf or gguf) if "llama.cpp" in models else None,
                  "text": str(text_file or "pydoc_data/topics.py"), "window": window, "windows": i + 1,
                  "scored_tokens": stats["transformers"].tokens, "engines": named,
                  "results": results(stats)}
        if out:  # after every window: a long run stopped early keeps what it scored
            out.write_text(json.dumps(report, indent=1))
    for name, r in report["results"].items():
        peer_line = f", {r['vs_llama_cpp']:+.3%} ± {r['vs_llama_cpp_95']:.3%} vs llama.cpp" if "vs_llama_cpp" in r else ""
        top1_line = (f" ({r['top1_vs_llama_cpp']:+.4f} ± {r['top1_vs_llama_cpp_se']:.4f} s.e. vs llama.cpp)"
                     if "top1_vs_llama_cpp" in r else "")
        click.echo(f"{name:14s} perplexity {r['perplexity']:.4f} ({r['perplexity'] / report['results']['transformers']['perplexity'] - 1:+.3%} "
                   f"± {r['vs_reference_95']:.3%} vs transformers{peer_line}), "
                   f"top-1 agreement {r['top1_agreement']:.4f}{top1_line}")


def results(stats: dict[str, Stats]) -> dict[str, dict]:
    """Each model's summary against transformers, and with a llama.cpp row its relative change from llama.cpp
    (95% interval from the windows' paired differences) and its top-1 agreement minus llama.cpp's with one
    standard error from the windows' paired differences of agreeing positions (windows taken as independent)."""
    table = {n: s.summary(stats["transformers"]) for n, s in stats.items()}
    peer = stats.get("llama.cpp")
    for name, s in stats.items():
        if peer is not None and name != "llama.cpp":
            table[name]["vs_llama_cpp"] = float(np.exp((s.nll - peer.nll) / s.tokens)) - 1
            table[name]["vs_llama_cpp_95"] = s.interval(peer)
            table[name]["top1_vs_llama_cpp"], table[name]["top1_vs_llama_cpp_se"] = s.top1_difference(peer)
    return table


if __name__ == "__main__":
    main()
