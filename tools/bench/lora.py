"""LoRA serving cost and the real adapter, in one run.

Throughput: one checkpoint built twice, with a `lora:` section and without; 4 random PEFT adapters (peft,
seeded). At each concurrency (16 and 1 by default) three cases run alternated, `--runs` times each, the median
reported: the engine built without LoRA, the LoRA engine's base model, and the LoRA engine with the requests
spread over the 4 adapters. Throughput = every request's generated tokens / wall time from submitting them all
to the last one's end (prefill included: that is what a server's clients see).

The real adapter (`--adapter`, from tools/lora/train_smollm2.py, with `--adapter-base`, the float32 SmolLM2
checkpoint from tools/lora/export_smollm2.py): a LoRA engine of that base served by engine-serve beside its
base model; the adapter's greedy answers to held-out chat prompts, by name over HTTP, against transformers +
PeftModel's.

    python -m tools.bench.lora --checkpoint checkpoints/trained/target --runs 5 \
        --adapter checkpoints/lora/smollm2-json --adapter-base checkpoints/lora/smollm2-f32
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import click
import torch

ADAPTERS = 4
NEW_TOKENS = 32
PROMPT_LEN = 16


def build(checkpoint: Path, out: Path, batch: int, lora: dict | None, max_seq_len: int = 256) -> Path:
    """A float32 CPU engine of `checkpoint`, with `lora` as its recipe's lora section (None: none)."""
    from builder.build import build_engine
    from builder.recipe import load_recipe

    base = {"model": str(checkpoint), **({"lora": lora} if lora else {})}
    recipe = load_recipe(base=base, overrides=[f"limits.max_seq_len={max_seq_len}", f"limits.max_batch_size={batch}",
                                               "verify.enabled=off"])
    return build_engine(recipe, out, log=lambda _: None)


def random_adapter(checkpoint: Path, out: Path, seed: int) -> Path:
    """A rank-16 PEFT adapter on every linear of the layers, random non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32),
                           LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]))
    model.save_pretrained(out)
    return out


def throughput(llm, prompts: list[list[int]], adapters: list[str | None]) -> float:
    """Generated tokens/s of every prompt submitted at once, prompt i on adapters[i % len(adapters)]."""
    from runtime.request.params import SamplingParams

    start = time.perf_counter()
    handles = [llm.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                            adapter=adapters[i % len(adapters)])) for i, p in enumerate(prompts)]
    tokens = sum(len(h.result().token_ids) for h in handles)
    return tokens / (time.perf_counter() - start)


def measure_cost(checkpoint: Path, work: Path, concurrencies: tuple[int, ...], runs: int) -> list[dict]:
    """Rows per concurrency: the three cases' median tokens/s and the ratios to the engine without LoRA."""
    from runtime.engine import LLM

    batch = max(concurrencies)
    plain_dir = build(checkpoint, work / "plain", batch, None)
    lora_dir = build(checkpoint, work / "lora", batch, {"max_rank": 16, "max_adapters": ADAPTERS})
    names = [f"a{i}" for i in range(ADAPTERS)]
    paths = {n: random_adapter(checkpoint, work / n, seed=i) for i, n in enumerate(names)}
    rng = torch.Generator().manual_seed(0)
    rows = []
    with LLM(plain_dir) as plain, LLM(lora_dir, adapters=paths) as lora:
        vocab = plain.manifest.vocab_size
        cases = {"no LoRA engine": (plain, [None]), "LoRA engine, base": (lora, [None]),
                 f"LoRA engine, {ADAPTERS} adapters": (lora, names)}
        for n in concurrencies:
            prompts = torch.randint(4, vocab, (n, PROMPT_LEN), generator=rng).tolist()
            for llm, adapters in cases.values():  # warm-up: call shapes bound, adapters placed
                throughput(llm, prompts, adapters)
            samples: dict[str, list[float]] = {case: [] for case in cases}
            for _ in range(runs):
                for case, (llm, adapters) in cases.items():
                    samples[case].append(throughput(llm, prompts, adapters))
            medians = {case: statistics.median(v) for case, v in samples.items()}
            ref = medians["no LoRA engine"]
            rows.append({"concurrency": n, "tok_s": medians, "ratio": {c: m / ref for c, m in medians.items()},
                         "runs": runs})
    return rows


def real_adapter(adapter: Path, base: Path, engine: Path, max_tokens: int) -> list[dict]:
    """The trained adapter served by name beside its base (on `engine`, built from `base` there unless it holds
    one): each held-out prompt's answers over HTTP and transformers + PeftModel's greedy answer."""
    import httpx
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.engine import LLM
    from runtime.serve.app import RunningServer, create_app
    from tools.lora.train_smollm2 import HELDOUT_PROMPTS

    if not (engine / "manifest.json").is_file():
        build(base, engine, 4, {"max_rank": 16, "max_adapters": 2}, max_seq_len=512)
    tokenizer = AutoTokenizer.from_pretrained(base)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    rows = []
    with LLM(engine, adapters={"json": adapter}) as llm:
        server = RunningServer(create_app({"smollm2": llm}))
        try:
            for prompt in HELDOUT_PROMPTS:
                messages = [{"role": "user", "content": prompt}]
                served = {model: httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
                    "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                }).json()["choices"][0]["message"]["content"] for model in ("smollm2", "json")}
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
                with torch.no_grad():
                    out = reference.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                             pad_token_id=tokenizer.eos_token_id)
                want = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                rows.append({"prompt": prompt, "base": served["smollm2"], "adapter": served["json"],
                             "peft": want, "equal": served["json"] == want})
        finally:
            server.stop()
    return rows


@click.command()
@click.option("--checkpoint", type=click.Path(path_type=Path, exists=True), default=Path("checkpoints/trained/target"),
              show_default=True, help="Hugging Face checkpoint the throughput engines are built from.")
@click.option("--concurrency", "concurrencies", default="16,1", show_default=True)
@click.option("--runs", default=5, show_default=True, type=click.IntRange(1))
@click.option("--adapter", type=click.Path(path_type=Path, exists=True), default=None,
              help="The trained SmolLM2 adapter (tools/lora/train_smollm2.py); with --adapter-base.")
@click.option("--adapter-base", type=click.Path(path_type=Path, exists=True), default=None,
              help="Its float32 base checkpoint (tools/lora/export_smollm2.py).")
@click.option("--adapter-engine", type=click.Path(path_type=Path), default=None,
              help="Where the adapter's LoRA engine is built, or is already (default: a temporary directory).")
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(1))
@click.option("--skip-cost", is_flag=True, help="Only the real adapter's check.")
def main(checkpoint, concurrencies, runs, adapter, adapter_base, adapter_engine, max_tokens, skip_cost):
    """Print the LoRA serving cost and the real adapter's answers as JSON."""
    from tools.bench.measure import int_list

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        work = Path(tmp)
        if not skip_cost:
            for row in measure_cost(checkpoint, work, int_list(concurrencies), runs):
                click.echo(json.dumps(row))
        if adapter is not None:
            if adapter_base is None:
                raise click.UsageError("--adapter needs --adapter-base (tools/lora/export_smollm2.py writes it)")
            rows = real_adapter(adapter, adapter_base, adapter_engine or work / "smollm2-lora", max_tokens)
            for row in rows:
                click.echo(json.dumps(row))
            click.echo(json.dumps({"adapter_equal_peft": sum(r["equal"] for r in rows), "prompts": len(rows),
                                   "adapter_differs_from_base": sum(r["adapter"] != r["base"] for r in rows)}))


if __name__ == "__main__":
    main()
