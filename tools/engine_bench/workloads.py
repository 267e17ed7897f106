"""Workloads: request shapes (prompt length, output length, arrival time) drawn from a seed, and
prompts of random token ids made from them. Shapes are shared by every mode of a run; token ids are
drawn again per mode and run, so no mode finds another's prompt in the KV cache by accident."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.engine_bench.config import LengthDist

FIRST_ID = 4  # ids below are the checkpoints' special tokens (<unk> <s> </s> <pad>)


class WorkloadError(ValueError):
    """The workload asks for something the engine cannot serve."""


@dataclass(frozen=True)
class Shape:
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0  # after the start of the measurement (open loop)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int
    arrival_s: float = 0.0


def fixed(batch: int, input_len: int, output_len: int) -> list[Shape]:
    return [Shape(input_len, output_len) for _ in range(batch)]


def stream(n: int, rate: float, inputs: LengthDist, outputs: LengthDist, seed: int) -> list[Shape]:
    """n requests with exponential inter-arrival times (a Poisson process of `rate` per second)."""
    rng = np.random.default_rng([seed, 1])
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) - 1.0 / rate  # the first one at ~0
    arrivals = np.maximum(arrivals, 0.0)
    return [Shape(p, o, float(a)) for p, o, a in zip(inputs.sample(rng, n), outputs.sample(rng, n), arrivals)]


def mixed(n: int, inputs: LengthDist, outputs: LengthDist, seed: int) -> list[Shape]:
    """n mixed-length requests without arrival times (a closed loop sends them)."""
    rng = np.random.default_rng([seed, 2])
    return [Shape(p, o) for p, o in zip(inputs.sample(rng, n), outputs.sample(rng, n))]


def materialize(shapes: list[Shape], vocab: int, content_seed: list[int]) -> list[Request]:
    rng = np.random.default_rng(content_seed)
    return [Request(rng.integers(FIRST_ID, vocab, s.prompt_len).tolist(), s.output_len, s.arrival_s) for s in shapes]


def shared_prefix(n: int, prefix_len: int, suffixes: LengthDist, output_len: int, vocab: int, seed: int,
                  content_seed: list[int]) -> list[Request]:
    """n requests: one system prompt of `prefix_len` tokens, then a distinct suffix each."""
    lengths = suffixes.sample(np.random.default_rng([seed, 3]), n)
    rng = np.random.default_rng(content_seed)
    system = rng.integers(FIRST_ID, vocab, prefix_len).tolist()
    return [Request(system + rng.integers(FIRST_ID, vocab, k).tolist(), output_len) for k in lengths]


def overload(shapes: list[Shape], tokens: int) -> list[Shape]:
    """Shapes taken in turn (cycling) until their prompt + output tokens reach `tokens`."""
    out, total = [], 0
    while total < tokens:
        shape = shapes[len(out) % len(shapes)]
        out.append(shape)
        total += shape.prompt_len + shape.output_len
    return out


def staggered(requests: list[Request], gap_s: float) -> list[Request]:
    """The requests arriving `gap_s` apart (open loop)."""
    return [Request(r.prompt, r.output_len, i * gap_s) for i, r in enumerate(requests)]


def check_fits(shapes: list[Shape] | list[Request], max_seq_len: int, what: str) -> None:
    """Refuse, before any work, a workload whose prompt + output exceeds the engine's KV length."""
    worst = max(shapes, key=lambda s: _prompt_len(s) + s.output_len)
    if _prompt_len(worst) + worst.output_len > max_seq_len:
        raise WorkloadError(f"{what}: a request of {_prompt_len(worst)} prompt + {worst.output_len} output tokens "
                         f"exceeds the engine's max_seq_len {max_seq_len}; shorten the workload or rebuild "
                         f"with a larger limits.max_seq_len")


def _prompt_len(s: Shape | Request) -> int:
    return s.prompt_len if isinstance(s, Shape) else len(s.prompt)


CHAT_PROMPTS = Path(__file__).resolve().parents[1] / "compress" / "eagle_prompts_eval.txt"


def chat_prompts(llm, n: int, output_len: int) -> list[Request]:
    """n requests from issue 49's held-out chat questions (ordinary answers, no copying), each a user message in
    the engine's chat template (the prompt length is the template's, not --spec-prompt-len)."""
    lines = [line.strip() for line in CHAT_PROMPTS.read_text(encoding="utf-8").splitlines()]
    questions = [line for line in lines if line and not line.startswith("#")]
    return [Request(llm.chat_prompt_ids([{"role": "user", "content": questions[i % len(questions)]}]), output_len)
            for i in range(n)]


def text_prompts(llm, kind: str, n: int, prompt_len: int, output_len: int) -> list[Request]:
    """n requests of `prompt_len` tokens cut from the held-out Python stdlib files (tools/corpus.py: text
    the trained checkpoints never saw), one file each, in the engine's tokenizer, each starting with
    EOS as the training text does.

    code: the start of a file, to be continued. copy: the start of a file, two blank lines, then its
    first eighth again: continuing it means copying the rest from the prompt (what prompt lookup is for)."""
    from tools.corpus import read_source, recorded_heldout_files

    if kind == "chat":
        return chat_prompts(llm, n, output_len)
    eos = min(llm.eos_ids)
    head = prompt_len // 8
    sep = llm.encode("\n\n\n")
    need = prompt_len - 1 if kind == "code" else prompt_len - 1 - len(sep) - head
    files = [llm.encode(read_source(p)) for p in sorted(recorded_heldout_files())]
    usable = [ids for ids in files if len(ids) >= need + (0 if kind == "code" else output_len)]
    if not usable:
        raise WorkloadError(f"speculative {kind}: no held-out stdlib file has {need} tokens; use a shorter "
                            f"--spec-prompt-len")
    out = []
    for i in range(n):
        ids = usable[i % len(usable)]
        prompt = [eos] + ids[:need] if kind == "code" else [eos] + ids[:need] + sep + ids[:head]
        out.append(Request(prompt, output_len))
    return out
