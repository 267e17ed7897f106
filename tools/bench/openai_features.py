"""The cost of engine-serve's OpenAI features on a batch (issue 39), in-process through the Python API (the path
every surface takes): 16 concurrent JSON-schema requests vs 16 free ones, and 16 requests with top-5 logprobs
vs 16 without, each pair alternated `--rounds` times on one loaded engine (ratios hold up on a shared machine;
absolute tokens/s do not), plus the grammar's compile time per schema (the Guide built when a request is
validated; the engine's one-time llguidance tokenizer view is timed apart).

    python -m tools.bench.openai_features --engine DIR [--rounds 3] [--tokens 64] [--json-out FILE]
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click

from runtime.engine import LLM
from runtime.request.params import SamplingParams
from runtime.request.structured import Guide, StructuredOutput, _ll_tokenizer

# "bio" first and long: every constrained row runs to max_new_tokens, as the free rows do (ignore_eos), so tokens/s
# compares the same work per step (rows that finish early would shrink the batch, not measure the mask)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["bio", "name", "age", "city", "hobbies"],
          "properties": {"bio": {"type": "string", "minLength": 400, "maxLength": 600},
                         "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}}}
TOPICS = ["a teacher", "a pilot", "a chef", "a painter", "a farmer", "a nurse", "a poet", "a sailor",
          "a doctor", "a baker", "a miner", "a judge", "a singer", "a coach", "a tailor", "a guard"]


def prompts(llm: LLM, n: int) -> list[list[int]]:
    """Chat prompts (the engine's template) asking for a person as JSON, or plain text without a template."""
    asks = [f"Describe {TOPICS[i % len(TOPICS)]} as JSON with name, age, city and hobbies." for i in range(n)]
    try:
        return [llm.chat_prompt_ids([{"role": "user", "content": a}]) for a in asks]
    except ValueError:
        return [llm.encode(a) for a in asks]


def tokens_per_s(llm: LLM, ids: list[list[int]], params: SamplingParams) -> tuple[float, int, float]:
    """(tokens/s, tokens, this process's CPU ms per token: less moved by other processes than wall time)."""
    start, cpu = time.perf_counter(), time.process_time()
    done = llm.generate(ids, params)
    tokens = sum(len(c.token_ids) for c in done)
    return tokens / (time.perf_counter() - start), tokens, 1e3 * (time.process_time() - cpu) / tokens


def pair(llm: LLM, ids, base: SamplingParams, feature: SamplingParams, rounds: int) -> dict:
    """Alternated runs of the two params; median tokens/s and CPU ms per token of each, the feature's cost in
    percent by each."""
    runs = {"base": [], "feature": []}
    for _ in range(rounds):
        for name, params in (("base", base), ("feature", feature)):
            runs[name].append(tokens_per_s(llm, ids, params))
    base_tps, feature_tps = (statistics.median(r[0] for r in runs[k]) for k in ("base", "feature"))
    base_cpu, feature_cpu = (statistics.median(r[2] for r in runs[k]) for k in ("base", "feature"))
    return {"base_tokens_per_s": round(base_tps, 1), "feature_tokens_per_s": round(feature_tps, 1),
            "cost_percent": round(100 * (1 - feature_tps / base_tps), 1),
            "base_cpu_ms_per_token": round(base_cpu, 2), "feature_cpu_ms_per_token": round(feature_cpu, 2),
            "cpu_cost_percent": round(100 * (feature_cpu / base_cpu - 1), 1),
            "tokens": {k: [r[1] for r in v] for k, v in runs.items()}}


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--batch", default=16, show_default=True, type=click.IntRange(1))
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 20))
@click.option("--tokens", default=64, show_default=True, type=click.IntRange(1), help="max_new_tokens per request")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(engine_dir: Path, batch: int, rounds: int, tokens: int, json_out: Path | None) -> None:
    """Structured-output and logprobs cost on one batch, alternated."""
    llm = LLM(engine_dir, max_batch_size=batch)
    try:
        ids = prompts(llm, batch)
        start = time.perf_counter()
        _ll_tokenizer(llm.tokenizer, llm.manifest.vocab_size, tuple(sorted(llm.eos_ids)))
        tokenizer_s = time.perf_counter() - start
        compile_ms = []
        for _ in range(5):
            start = time.perf_counter()
            Guide(StructuredOutput.json(SCHEMA), llm.tokenizer, llm.manifest.vocab_size, llm.eos_ids)
            compile_ms.append(1e3 * (time.perf_counter() - start))
        llm.generate(ids[:2], SamplingParams(max_new_tokens=4))  # warm the call shapes
        # free rows generate as many tokens as the JSON ones may (ignore_eos): tokens/s compares like with like
        structured = pair(llm, ids, SamplingParams(max_new_tokens=tokens, ignore_eos=True),
                          SamplingParams(max_new_tokens=tokens, structured=StructuredOutput.json(SCHEMA)), rounds)
        logprobs = pair(llm, ids, SamplingParams(max_new_tokens=tokens, ignore_eos=True),
                        SamplingParams(max_new_tokens=tokens, ignore_eos=True, logprobs=5), rounds)
    finally:
        llm.close()
    report = {"engine": str(engine_dir), "batch": batch, "rounds": rounds, "max_new_tokens": tokens,
              "llguidance_tokenizer_s": round(tokenizer_s, 2), "schema_compile_ms": [round(x, 2) for x in compile_ms],
              "json_schema_vs_free": structured, "logprobs_top5_vs_none": logprobs}
    click.echo(json.dumps(report, indent=1))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
