"""Train small Llama-family checkpoints (a target and a draft) on the Python standard library's source.

The checkpoints exist so that quantization accuracy and speculative decoding can be measured on a
model whose outputs mean something. Everything is offline and deterministic: the corpus is this
interpreter's own stdlib, split into training and held-out files by a hash of each file's path; the
byte-level BPE tokenizer, data order and initialisation are all seeded.

    python -m tools.checkpoints.train_tiny_model --out checkpoints/trained [--steps N] [--draft-steps M] [--seed 0] [--threads 2]
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch
import torch.nn.functional as F
from tqdm import tqdm

from tools.corpus import (  # noqa: F401  (re-exported for the tests)
    EXCLUDED_DIRS, HELDOUT_BUCKETS, HELDOUT_LIST, corpus_files, heldout_files, read_source, stdlib_relative,
    stdlib_root, training_files,
)

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 256
MAX_POSITIONS = 1024
EVAL_WINDOWS = 256
SAMPLE_PROMPTS = ("def ", "import os\n", "class ")
# Pre-tokens: a word or a punctuation run with at most one trailing space, or a whitespace run (newline plus
# indentation). Unlike GPT-2's split, the space stays with the word before it, so prompts such as "def " or
# "import " tokenize exactly as they do inside training text.
PRETOKEN_PATTERN = r"[\p{L}\p{N}_]+ ?|[^\s\p{L}\p{N}_]+ ?|\s+"


@dataclass(frozen=True)
class ModelSpec:
    """Architecture and optimiser settings of one checkpoint."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    lr: float  # AdamW: embeddings, lm_head, norms
    muon_lr: float = 0.02  # Muon: the matrices inside the layers
    batch_size: int = 8


# Sizes for 2 CPU cores without AVX-512 (float32 training, ~2,600 and ~6,200 tokens/s): most of a ~15-minute
# budget goes to the target; a larger target would see too few tokens to beat its draft.
TARGET = ModelSpec("target", 192, 512, 4, 6, 2, 32, lr=6e-3)
DRAFT = ModelSpec("draft", 128, 344, 2, 4, 2, 32, lr=6e-3)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts`, with `<|endoftext|>` as id 0.

    Pre-tokenization splits on PRETOKEN_PATTERN, then maps bytes to ByteLevel symbols (no GPT-2 regex).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def hf_tokenizer(tokenizer):
    """Wrap a `tokenizers.Tokenizer` as a transformers fast tokenizer with EOT as bos/eos/pad."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts encoded and concatenated, each preceded by EOT, as a 1-D int64 tensor."""
    eot = tokenizer.token_to_id(EOT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(eot)
        ids.extend(encoding.ids)
    return torch.tensor(ids, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# Model and training
# ----------------------------------------------------------------------------------------------


def llama_config(spec: ModelSpec, vocab_size: int, eot_id: int):
    """The `LlamaConfig` of a spec."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )


def _lr_lambda(steps: int):
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class Muon(torch.optim.Optimizer):
    """Nesterov momentum orthogonalized by a Newton-Schulz iteration (Jordan et al. 2024), in float32.

    torch.optim.Muon iterates in bfloat16, which CPUs without AVX-512 BF16 emulate ~10x slower than float32
    matmuls. The update is scaled by 0.2 * sqrt(max(rows, cols)) to AdamW's update RMS (Liu et al. 2025)."""

    def __init__(self, params, lr: float, momentum: float = 0.95, ns_steps: int = 5):
        super().__init__(params, {"lr": lr, "momentum": momentum, "ns_steps": ns_steps})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                update = _orthogonalize(p.grad.add(buf, alpha=group["momentum"]), group["ns_steps"])
                p.add_(update, alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape)))


def _orthogonalize(g: torch.Tensor, steps: int) -> torch.Tensor:
    """~U V^T of g = U S V^T: the quintic Newton-Schulz iteration with Muon's coefficients."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T  # [small, large]: the iteration's matmuls are small x small
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x if wide else x.T


def _optimizers(model: torch.nn.Module, spec: ModelSpec) -> list[torch.optim.Optimizer]:
    """Muon for the layers' 2-D weights; AdamW for embeddings, lm_head and norms. No weight decay: the
    runs see less than one epoch of the data."""
    named = list(model.named_parameters())
    matrix = [p for n, p in named if p.ndim == 2 and ".layers." in n]
    rest = [p for n, p in named if not (p.ndim == 2 and ".layers." in n)]
    return [Muon(matrix, lr=spec.muon_lr),
            torch.optim.AdamW(rest, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)]


def _batch(stream: torch.Tensor, batch_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, stream.numel() - SEQ_LEN - 1, (batch_size,), generator=gen)
    windows = torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def _lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_model(spec: ModelSpec, config, stream: torch.Tensor, steps: int, seed: int,
                teacher: torch.nn.Module | None = None) -> tuple[torch.nn.Module, float]:
    """Train one model from scratch in float32 (Muon + AdamW); returns it and its final train loss.

    With a `teacher`, the loss is the cross-entropy against the teacher's next-token distribution on the
    same windows (distillation, as speculative-decoding drafts are made: the draft learns to predict
    what the target would say, which is what acceptance measures)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.train()
    optimizers = _optimizers(model, spec)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, _lr_lambda(steps)) for o in optimizers]
    gen = torch.Generator().manual_seed(seed + 1)
    recent: list[float] = []
    bar = tqdm(range(steps), desc=f"train {spec.name}", unit="step", dynamic_ncols=True)
    for _ in bar:
        inputs, targets = _batch(stream, spec.batch_size, gen)
        loss = _lm_loss(model, inputs, targets) if teacher is None else _distill_loss(model, teacher, inputs)
        model.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer, scheduler in zip(optimizers, schedulers):
            optimizer.step()
            scheduler.step()
        recent = (recent + [loss.item()])[-20:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}", lr=f"{schedulers[1].get_last_lr()[0]:.2e}")
    model.eval()
    return model, sum(recent) / max(1, len(recent))


def _distill_loss(model: torch.nn.Module, teacher: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        soft = F.softmax(teacher(input_ids=inputs).logits.float(), dim=-1)  # [batch, seq, vocab]
    logp = F.log_softmax(model(input_ids=inputs).logits.float(), dim=-1)
    return -(soft * logp).sum(-1).mean()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, stream: torch.Tensor, windows: int = EVAL_WINDOWS) -> float:
    """Mean next-token cross-entropy (fp32) over the first `windows` non-overlapping SEQ_LEN windows."""
    count = min(windows, (stream.numel() - 1) // SEQ_LEN)
    total = 0.0
    for first in range(0, count, 16):
        rows = range(first, min(count, first + 16))
        chunk = torch.stack([stream[r * SEQ_LEN : r * SEQ_LEN + SEQ_LEN + 1] for r in rows])
        total += _lm_loss(model, chunk[:, :-1], chunk[:, 1:]).item() * len(rows)
    return total / count


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of the held-out tokens under the add-one-smoothed training unigram distribution."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return -logp[heldout].mean().item()


def greedy_sample(model: torch.nn.Module, tokenizer, prompt: str, new_tokens: int = 48) -> str:
    """Greedy continuation of `prompt` (text of the continuation only)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :])


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------


def round_to_fp16(model: torch.nn.Module) -> None:
    """Round weights to float16 in place (kept as float32), so evaluation sees the stored values."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.half().float())


# The models complete Python source and never saw a conversation: a chat is rendered as source they know
# (checkpoints/trained/*/chat_template.jinja, which tests/builder/test_trained_checkpoint.py keeps equal to this file).
CHAT_TEMPLATE = Path(__file__).with_name("trained_chat_template.jinja")


def save_checkpoint(model: torch.nn.Module, tokenizer, out_dir: Path) -> None:
    """Save a HF checkpoint dir: float16 safetensors, config (dtype float32), generation config, tokenizer and
    the chat template."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*"):
        if stale.is_file():
            stale.unlink()
    eot = tokenizer.convert_tokens_to_ids(EOT)
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=False)
    model.half().save_pretrained(out_dir, safe_serialization=True)
    model.float()
    config = json.loads((out_dir / "config.json").read_text())
    config["dtype"] = "float32"  # stored weights are float16; transformers upcasts them exactly on load
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE.read_text())


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def write_heldout_list(files: list[Path]) -> None:
    """Record the held-out files (relative to the stdlib) in data/heldout_files.txt."""
    HELDOUT_LIST.parent.mkdir(parents=True, exist_ok=True)
    header = f"# Python {platform.python_version()} stdlib files held out of training (sha256(path) % {HELDOUT_BUCKETS} == 0)\n"
    HELDOUT_LIST.write_text(header + "".join(f"{stdlib_relative(p)}\n" for p in files))


def write_readme(out: Path, report: dict) -> None:
    """Write out/README.md describing the checkpoints and how they were made."""
    lines = [
        "# Trained tiny Llama checkpoints",
        "",
        "Small `LlamaForCausalLM` models trained from scratch on the Python standard library's own source, so that",
        "quantization accuracy and speculative decoding can be measured on a model whose outputs mean something.",
        "`draft/` shares `target/`'s tokenizer (identical `tokenizer.json`) and is meant as its speculative draft.",
        "",
        "Re-create both (deterministic for a given machine, thread count and Python version):",
        "",
        "```",
        f"python -m tools.checkpoints.train_tiny_model --out checkpoints/trained --steps {report['steps']} --draft-steps {report['draft_steps']} "
        f"--seed {report['seed']} --threads {report['threads']}",
        "```",
        "",
        "## Data",
        "",
        f"- Corpus: `.py` files of the Python {report['python']} stdlib (`sysconfig.get_paths()['stdlib']`), sorted by",
        f"  relative path, excluding directories {', '.join(f'`{d}`' for d in sorted(EXCLUDED_DIRS))} and `test_*.py` files.",
        f"- Held out: files whose relative path's sha256 (first 8 bytes, big-endian) is 0 mod {HELDOUT_BUCKETS}:",
        f"  {report['heldout_files']} files, {report['heldout_tokens']:,} tokens (list below and in `data/heldout_files.txt`).",
        f"- Training: the other {report['training_files']} files, {report['train_tokens']:,} tokens. Each file is preceded by `{EOT}`;",
        f"  batches are random {SEQ_LEN}-token windows of the concatenation (seeded generator).",
        "- Tokenizer: byte-level BPE (`tokenizers` BpeTrainer, ByteLevel pre-tokenizer/decoder) trained on the training",
        f"  files only, vocab {report['vocab_size']}, `{EOT}` (id {report['eot_id']}) is bos, eos and pad. No special tokens are added",
        "  automatically when encoding. Pre-tokens are split by the regex `" + PRETOKEN_PATTERN + "` before the",
        "  byte mapping (instead of GPT-2's regex): a single space stays with the word before it, so prompts like `def `",
        "  or `import ` end in the same token (`defĠ`) as in training text, and newline+indentation runs become tokens.",
        "",
        "## Models",
        "",
        "| | hidden | layers | heads / kv heads | head_dim | intermediate | params | steps x batch x seq | peak lr | train time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("target", "draft"):
        m = report["models"][name]
        s = m["spec"]
        lines.append(
            f"| {name} | {s['hidden_size']} | {s['num_hidden_layers']} | {s['num_attention_heads']} / {s['num_key_value_heads']} "
            f"| {s['head_dim']} | {s['intermediate_size']} | {m['params']:,} | {m['steps']} x {s['batch_size']} x {SEQ_LEN} "
            f"| {s['lr']:g} | {m['train_seconds']:.0f} s |"
        )
    lines += [
        "",
        f"Common: vocab {report['vocab_size']}, max_position_embeddings {MAX_POSITIONS}, RoPE theta 10000, RMSNorm eps 1e-5,",
        "SiLU MLP, untied embeddings. Training in float32: Muon (momentum 0.95, Newton-Schulz in float32, update",
        f"scaled to AdamW's RMS) at lr {TARGET.muon_lr:g} for the layers' matrices, AdamW (betas 0.9/0.95, no weight decay) at the",
        "table's peak lr for embeddings, lm_head and norms; linear warmup (5% of steps) then cosine decay to 10% of",
        "peak, grad clip 1.0,",
        f"seed {report['seed']}, {report['threads']} torch threads, {report['total_seconds']:.0f} s wall time for everything.",
        "",
        "The draft is distilled from the finished target: its loss is the cross-entropy against the target's next-token",
        "distribution on the same windows (the target runs alongside without gradients), because a draft is worth what",
        "its agreement with the target is worth. It gets fewer steps: most of the ~15-minute budget goes to the target,",
        "which has to end clearly better than its draft.",
        "",
        "## Storage",
        "",
        "Weights are stored as **float16** safetensors to keep the files small; `config.json` says `dtype: float32`, so",
        "`AutoModelForCausalLM.from_pretrained(dir)` upcasts them (exactly) to float32. The losses below are for these",
        "fp16-rounded weights computed in float32.",
        "",
        f"Sizes: target {report['models']['target']['bytes'] / 1e6:.2f} MB, draft {report['models']['draft']['bytes'] / 1e6:.2f} MB,"
        f" total {report['total_bytes'] / 1e6:.2f} MB (10^6 bytes, tokenizer files included).",
        "",
        "## Results",
        "",
        f"Held-out loss is over the first {report['eval_tokens']:,} held-out tokens ({EVAL_WINDOWS} windows of {SEQ_LEN}).",
        "",
        "| | final train loss (mean of last 20 steps; the draft's is against the target's distribution) | held-out loss "
        "| held-out perplexity |",
        "|---|---|---|---|",
    ]
    for name in ("target", "draft"):
        m = report["models"][name]
        lines.append(f"| {name} | {m['train_loss']:.3f} | {m['heldout_loss']:.3f} | {math.exp(m['heldout_loss']):.2f} |")
    lines += [
        f"| uniform baseline | | {math.log(report['vocab_size']):.3f} | {report['vocab_size']} |",
        f"| unigram baseline (train counts) | | {report['unigram_loss']:.3f} | {math.exp(report['unigram_loss']):.1f} |",
        "",
        "Greedy continuations by the target (48 new tokens after each prompt):",
        "",
    ]
    for prompt, text in report["samples"].items():
        lines += ["```python", prompt + text, "```", ""]
    lines += ["## Held-out files", ""] + [f"- `{rel}`" for rel in report["heldout_list"]] + [""]
    (out / "README.md").write_text("\n".join(lines))


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def _train_and_save(spec: ModelSpec, data: dict, steps: int, seed: int, out: Path,
                    teacher: torch.nn.Module | None = None) -> tuple[torch.nn.Module, dict]:
    start = time.perf_counter()
    config = llama_config(spec, data["vocab_size"], data["eot_id"])
    model, train_loss = train_model(spec, config, data["train"], steps, seed, teacher)
    seconds = time.perf_counter() - start
    round_to_fp16(model)
    loss = heldout_loss(model, data["heldout"])
    save_checkpoint(model, data["hf_tokenizer"], out / spec.name)
    click.echo(f"{spec.name}: train loss {train_loss:.3f}, held-out loss {loss:.3f} (ppl {math.exp(loss):.2f}), {seconds:.0f} s")
    info = {
        "spec": asdict(spec),
        "steps": steps,
        "params": _param_count(model),
        "train_loss": train_loss,
        "heldout_loss": loss,
        "train_seconds": seconds,
        "bytes": _dir_size(out / spec.name),
    }
    return model, info


def _prepare_data() -> dict:
    train_paths, heldout_paths = training_files(), heldout_files()
    train_texts = [read_source(p) for p in train_paths]
    tokenizer = train_tokenizer(train_texts)
    data = {
        "train_paths": train_paths,
        "heldout_paths": heldout_paths,
        "tokenizer": tokenizer,
        "hf_tokenizer": hf_tokenizer(tokenizer),
        "vocab_size": tokenizer.get_vocab_size(),
        "eot_id": tokenizer.token_to_id(EOT),
        "train": token_stream(tokenizer, train_texts),
        "heldout": token_stream(tokenizer, [read_source(p) for p in heldout_paths]),
    }
    return data


@click.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("checkpoints/trained"), show_default=True)
@click.option("--steps", type=int, default=560, show_default=True, help="Optimizer steps for the target.")
@click.option("--draft-steps", type=int, default=300, show_default=True, help="Optimizer steps for the draft.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True, help="torch (and tokenizers) threads.")
def main(out: Path, steps: int, draft_steps: int, seed: int, threads: int) -> None:
    """Train the target and draft checkpoints on the Python stdlib and write them (plus README.md) under OUT."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    start = time.perf_counter()
    data = _prepare_data()
    click.echo(
        f"data: {len(data['train_paths'])} training files ({data['train'].numel():,} tokens), "
        f"{len(data['heldout_paths'])} held-out files ({data['heldout'].numel():,} tokens), "
        f"vocab {data['vocab_size']}, {time.perf_counter() - start:.0f} s"
    )
    models = {}
    target, models["target"] = _train_and_save(TARGET, data, steps, seed, out)
    _, models["draft"] = _train_and_save(DRAFT, data, draft_steps, seed, out, teacher=target)
    samples = {p: greedy_sample(target, data["hf_tokenizer"], p) for p in SAMPLE_PROMPTS}
    write_heldout_list(data["heldout_paths"])
    report = {
        "steps": steps,
        "draft_steps": models["draft"]["steps"],
        "seed": seed,
        "threads": threads,
        "python": platform.python_version(),
        "vocab_size": data["vocab_size"],
        "eot_id": data["eot_id"],
        "training_files": len(data["train_paths"]),
        "heldout_files": len(data["heldout_paths"]),
        "train_tokens": data["train"].numel(),
        "heldout_tokens": data["heldout"].numel(),
        "eval_tokens": min(EVAL_WINDOWS, (data["heldout"].numel() - 1) // SEQ_LEN) * SEQ_LEN,
        "unigram_loss": unigram_loss(data["train"], data["heldout"], data["vocab_size"]),
        "models": models,
        "total_bytes": sum(m["bytes"] for m in models.values()),
        "samples": samples,
        "heldout_list": [stdlib_relative(p) for p in data["heldout_paths"]],
        "total_seconds": time.perf_counter() - start,
    }
    write_readme(out, report)
    for prompt, text in samples.items():
        click.echo(f"--- {prompt!r}\n{prompt}{text}")
    click.echo(f"wrote {out} ({report['total_bytes'] / 1e6:.2f} MB) in {report['total_seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
