"""engine-compress: prune a Llama-family checkpoint by a plan and/or distill it (or a draft for a target) on text;
writes a checkpoint engine-build takes as is.

    engine-compress TEACHER --out DIR --text FILE_OR_DIR [--layers N] [--heads N] [--ffn N] [--hidden N]
                    [--plan plan.yaml] [--steps N ...] [--draft-for TARGET] [--device cpu|cuda]
"""
from __future__ import annotations

import copy
import dataclasses
import shutil
import sys
from pathlib import Path

import click
import torch

from builder.compress.checkpoint import checkpoint_dir, load_config, load_model, load_tokenizer, save_checkpoint
from builder.compress.data import load_windows, window_replies, windows
from builder.compress.distill import TOPK_FILE, DistillConfig, Interrupted, Trainer, atomic_save, teacher_topk
from builder.compress.eagle import (EagleConfig, EagleHead, EagleTrainer, SavedHead, draft_vocabulary, evaluate_head,
                                    read_head, save_head, target_features, target_identity, FEATURES_FILE)
from builder.compress.draft import (chat_stream, check_same_tokenizer, greedy_agreement, on_policy_rows,
                                   read_prompts)
from builder.compress.importance import activation_scores, perplexity_scores
from builder.compress.plan import DEPTH_METRICS, CompressError, PrunePlan, load_plan
from builder.compress.prune import choose, prune

TRAIN_DIR = "train"  # <out>/train: the resumable state, the teacher's top-k cache, the target's generations
GENERATIONS_FILE = "generations.pt"
CHAT_FILE = "chat_answers.pt"


@dataclasses.dataclass(frozen=True)
class TextSpec:
    """Where the text comes from and how it is cut: `text` trains and calibrates, `heldout` evaluates (default:
    the last tenth of `text`'s windows, then never trained on); `on_policy` rows of target generations after
    `prompt_len` prompt tokens, and the target's answers (up to `answer_tokens`) to the user messages in the file
`chat_prompts`, are added in draft mode."""

    text: tuple[str, ...]
    heldout: tuple[str, ...] = ()
    seq_len: int = 256
    calib_windows: int = 64
    heldout_windows: int = 32
    on_policy: int = 0
    prompt_len: int = 16
    chat_prompts: str | None = None
    answer_tokens: int = 128


def _split_text(tokenizer, spec: TextSpec) -> tuple[torch.Tensor, torch.Tensor]:
    rows = load_windows(tokenizer, list(spec.text), spec.seq_len)
    if spec.heldout:
        return rows, load_windows(tokenizer, list(spec.heldout), spec.seq_len, spec.heldout_windows)
    cut = max(1, min(spec.heldout_windows, rows.shape[0] // 10))
    if rows.shape[0] - cut < 1:
        raise CompressError(f"the text makes {rows.shape[0]} window(s) of {spec.seq_len + 1} tokens: too few to hold "
                            f"some out; give more text, --heldout, or a smaller --seq-len")
    return rows[:-cut], rows[-cut:]


def _check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise CompressError("--device cuda: torch sees no CUDA device here (torch "
                            f"{torch.__version__}); use --device cpu or install a CUDA build of torch")


def compress(teacher: str | Path, out: str | Path, plan: PrunePlan, cfg: DistillConfig, text: TextSpec,
             draft_for: str | Path | None = None, device: str = "cpu", gguf_file: str | None = None,
             on_step=None) -> Path:
    """Prune `teacher` by `plan`, distill it for cfg.steps (from the teacher, or from `draft_for` as its draft),
    write the checkpoint into `out`. Every input is checked before any work; an interrupted run (Interrupted)
    resumes when called again with the same arguments."""
    teacher, out = checkpoint_dir(teacher, "teacher", gguf_file), Path(out)
    _check_device(device)
    plan.check(load_config(teacher, gguf_file))
    tokenizer = load_tokenizer(teacher, gguf_file)
    if draft_for is not None:
        draft_for = checkpoint_dir(draft_for, "--draft-for")
        check_same_tokenizer(tokenizer, load_tokenizer(draft_for), teacher, draft_for)
    if text.chat_prompts and draft_for is None:
        raise CompressError("--chat-prompts trains a draft on its target's answers: give --draft-for TARGET too")
    chat = read_prompts(text.chat_prompts) if text.chat_prompts else []
    rows, heldout = _split_text(tokenizer, text)
    model = load_model(teacher, device, gguf_file)
    report: dict = {"teacher": str(teacher), "plan": dataclasses.asdict(plan), "distill": dataclasses.asdict(cfg),
                    "draft_for": None if draft_for is None else str(draft_for)}
    student = _prune(model, plan, rows[: text.calib_windows].to(device), report) if plan.prunes \
        else copy.deepcopy(model)
    same = draft_for is None or draft_for.resolve() == teacher.resolve()
    target = model if same else load_model(draft_for, device)
    if draft_for is not None and text.on_policy and cfg.steps:
        rows = torch.cat([_generations(target, rows[: text.on_policy], text.prompt_len, out / TRAIN_DIR, device), rows])
    if chat and cfg.steps:
        stream = _cached(out / TRAIN_DIR / CHAT_FILE, chat, lambda: chat_stream(
            target, tokenizer, chat, text.answer_tokens, device))
        rows = torch.cat([windows(stream, text.seq_len), rows])
    if cfg.steps:
        report["history"] = _train(student, target, cfg, rows, heldout, out / TRAIN_DIR, device, on_step)
    if draft_for is not None:
        report["greedy_agreement_heldout"] = greedy_agreement(student, target, heldout[:, :-1].to(device))
    save_checkpoint(student, tokenizer, teacher, out, report)
    shutil.rmtree(out / TRAIN_DIR, ignore_errors=True)
    return out


def compress_eagle(target: str | Path, out: str | Path, cfg: DistillConfig, eagle: EagleConfig, text: TextSpec,
                   device: str = "cpu", gguf_file: str | None = None, on_step=None,
                   init_head: str | Path | None = None) -> Path:
    """Train an EAGLE draft head for `target` (builder/compress/eagle.py) on the target's features over the text
    (and its own continuations of text.on_policy windows / answers to text.chat_prompts), for cfg.steps or
    cfg.max_minutes; write the head folder `out`. `init_head`: a head folder an earlier run wrote for this target,
    whose weights and draft vocabulary the training starts from (a new optimizer and schedule). Resumes like
    `compress` (the resumed state, not the init head, holds the weights then)."""
    target, out = checkpoint_dir(target, "target", gguf_file), Path(out)
    _check_device(device)
    tokenizer = load_tokenizer(target, gguf_file)
    identity = target_identity(load_config(target, gguf_file), tokenizer)
    start = read_head(init_head, identity) if init_head is not None else None
    chat = read_prompts(text.chat_prompts) if text.chat_prompts else []
    rows, heldout = _split_text(tokenizer, text)
    model = load_model(target, device, gguf_file)
    train_dir = out / TRAIN_DIR
    if text.on_policy:
        rows = torch.cat([_generations(model, rows[: text.on_policy], text.prompt_len, train_dir, device), rows])
    if chat:
        stream = _cached(train_dir / CHAT_FILE, chat, lambda: chat_stream(model, tokenizer, chat, text.answer_tokens,
                                                                           device))
        rows = torch.cat([windows(stream, text.seq_len), rows])
    draft_ids, coverage = _draft_vocabulary(rows, model.config, eagle, start)
    replies = window_replies(heldout, tokenizer)  # the held-out figures score the drafts the engine makes: replies'
    scored = torch.ones_like(heldout, dtype=torch.bool) if replies is None else replies
    held = torch.isin(heldout[:, 1:], draft_ids)[scored[:, 1:]].double().mean().item()
    whose = " (the init head's)" if start else ""
    click.echo(f"engine-compress: draft vocabulary {len(draft_ids)} of {model.config.vocab_size} tokens{whose}: "
               f"covers {coverage:.4f} of the training tokens, {held:.4f} of the held-out "
               f"{'replies' if replies is not None else 'text'}", err=True)
    features = target_features(model, rows, train_dir / FEATURES_FILE, device)
    held_features = target_features(model, heldout, train_dir / ("heldout_" + FEATURES_FILE), device)
    head = EagleHead(model, draft_ids, eagle.train_lm_head)
    if start is not None:
        start.load_into(head)
    full_head = model.get_output_embeddings().weight.detach()
    trainer = EagleTrainer(head, cfg, eagle, train_dir, full_head, device)
    trainer.heldout_features, trainer.heldout_replies = held_features, replies
    trainer.origin = None if start is None else str(start.path.resolve())
    if trainer.resume():  # its state's weights replace the init head's
        click.echo(f"engine-compress: resuming from step {trainer.step} ({trainer.state_path})", err=True)
    elif start is not None:
        click.echo(f"engine-compress: starting from the head in {start.path} ({start.steps} steps)", err=True)
    history = trainer.run(rows, heldout, features, on_step)
    final = evaluate_head(head, full_head.to(device), heldout, held_features, device, replies=replies)
    config = model.config
    before = {} if start is None else start.provenance()
    record = {"target": str(target), "architecture": config.architectures[0] if config.architectures else
              type(model).__name__, **identity, "coverage_training": coverage, "coverage_heldout": held,
              "heldout": final, "distill": dataclasses.asdict(cfg), "eagle": dataclasses.asdict(eagle),
              "history": history, "steps_total": before.get("steps_before", 0) + trainer.step, **before}
    save_head(head, out, record)
    shutil.rmtree(train_dir, ignore_errors=True)
    return out


def _draft_vocabulary(rows: torch.Tensor, config, eagle: EagleConfig, start: SavedHead | None
                      ) -> tuple[torch.Tensor, float]:
    """The head's draft ids [K] and the share of the training tokens they cover: counted on `rows`, or, from an
    init head, its own (its lm_head rows are those ids'; --eagle-coverage does not apply)."""
    if start is not None:
        return start.draft_ids, torch.isin(rows[:, 1:], start.draft_ids).double().mean().item()
    eos = config.eos_token_id
    return draft_vocabulary(rows, config.vocab_size, eagle.coverage,
                            tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ())


def _prune(model, plan: PrunePlan, calib: torch.Tensor, report: dict):
    """The student `plan` keeps, by importance on `calib`; the selection and its scores go into `report`."""
    scores = activation_scores(model, calib)
    if plan.depth_metric == "perplexity":
        scores.layers_perplexity = perplexity_scores(model, calib)
    selection = choose(plan, scores, model.config)
    report["selection"] = selection.to_json()
    return prune(model, selection)


def _generations(target, prompts: torch.Tensor, prompt_len: int, train_dir: Path, device: str) -> torch.Tensor:
    """The target's continuations of the prompts, generated once per run (kept in train_dir for a resume)."""
    path = train_dir / GENERATIONS_FILE
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if torch.equal(saved[:, :prompt_len], prompts[:, :prompt_len]):
            return saved
    train_dir.mkdir(parents=True, exist_ok=True)
    generated = on_policy_rows(target, prompts, prompt_len, device)
    atomic_save(generated, path)
    return generated


def _cached(path: Path, key, make) -> torch.Tensor:
    """make()'s tensor, saved once at `path` with `key` and reused by a resumed run with the same key."""
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["key"] == key:
            return saved["value"]
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make()
    atomic_save({"key": key, "value": value}, path)
    return value


def _train(student, teacher, cfg: DistillConfig, rows, heldout, train_dir: Path, device: str, on_step) -> list[dict]:
    train_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(student, teacher, cfg, train_dir, device)
    if trainer.resume():
        click.echo(f"engine-compress: resuming from step {trainer.step} ({trainer.state_path})", err=True)
    topk = teacher_topk(teacher, rows, cfg.top_k, cfg.temperature, train_dir / TOPK_FILE, device) if cfg.top_k else None
    return trainer.run(rows, heldout, topk, on_step)


def _distill_options(func):
    """One --option per DistillConfig field (its name with dashes, its default)."""
    for field in reversed(dataclasses.fields(DistillConfig)):
        func = click.option(f"--{field.name.replace('_', '-')}", field.name, type=type(field.default),
                            default=field.default, show_default=True)(func)
    return func


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("teacher", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="Folder for the student checkpoint.")
@click.option("--text", "text", multiple=True, required=True, help="Training / calibration text: files or folders.")
@click.option("--heldout", multiple=True, help="Held-out text (default: the last tenth of --text's windows).")
@click.option("--plan", "plan_file", type=click.Path(), help="YAML plan: layers, heads, ffn, hidden, depth_metric.")
@click.option("--layers", type=int, help="Decoder layers to keep.")
@click.option("--heads", type=int, help="Attention heads to keep per layer (whole KV groups).")
@click.option("--ffn", type=int, help="MLP intermediate channels to keep per layer.")
@click.option("--hidden", type=int, help="Hidden channels to keep.")
@click.option("--depth-metric", type=click.Choice(DEPTH_METRICS), help="How layers are ranked (default block).")
@_distill_options
@click.option("--seq-len", default=256, show_default=True, help="Tokens per training window.")
@click.option("--calib-windows", default=64, show_default=True, help="Windows of --text for importance scores.")
@click.option("--heldout-windows", default=32, show_default=True, help="Held-out windows evaluated.")
@click.option("--draft-for", type=click.Path(), help="Distill a speculative draft for this target checkpoint.")
@click.option("--on-policy", default=0, show_default=True, help="Draft mode: target generations to train on.")
@click.option("--prompt-len", default=16, show_default=True, help="Draft mode: prompt tokens of each generation.")
@click.option("--chat-prompts", type=click.Path(), help="Draft mode: user messages (a line each) the target "
              "answers greedily; the conversations are training text.")
@click.option("--answer-tokens", default=128, show_default=True, help="Draft mode: tokens per chat answer at most.")
@click.option("--eagle", is_flag=True, help="Train an EAGLE draft head for TEACHER (the target) instead of a "
              "student: its features and next-token distribution over --text (and --on-policy / --chat-prompts).")
@click.option("--draft-kind", type=click.Choice(["model", "eagle"]), help="'eagle' = --eagle; 'model' (default): "
              "a pruned, distilled student (--draft-for).")
@click.option("--eagle-coverage", default=0.97, show_default=True, help="Draft vocabulary: the most frequent "
              "training tokens covering this share.")
@click.option("--eagle-hidden-weight", default=1.0, show_default=True, help="Weight of the next-feature loss.")
@click.option("--eagle-train-chain", default=2, show_default=True, help="Chain positions trained: 1 = the target's "
              "features only; 2, 3 = plus passes fed the head's own features (the training-time test).")
@click.option("--eagle-train-lm-head/--eagle-freeze-lm-head", default=True, show_default=True,
              help="Train the draft lm_head, or keep the target's rows of the draft vocabulary.")
@click.option("--init-head", type=click.Path(), help="EAGLE: start from this head folder (an earlier --eagle "
              "run's --out, for the same target) and keep its draft vocabulary; its record is carried on.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--gguf-file", help="The teacher is this GGUF file inside TEACHER (read by transformers).")
@click.option("--threads", type=int, help="torch CPU threads.")
def main(teacher, out, text, heldout, plan_file, layers, heads, ffn, hidden, depth_metric, seq_len, calib_windows,
         heldout_windows, draft_for, on_policy, prompt_len, chat_prompts, answer_tokens, eagle, draft_kind,
         eagle_coverage, eagle_hidden_weight, eagle_train_chain, eagle_train_lm_head, init_head, device, gguf_file,
         threads, **distill) -> None:
    """Prune TEACHER (a Hugging Face Llama-family checkpoint folder) by a plan and distill it on text."""
    if threads:
        torch.set_num_threads(threads)
    try:
        spec = TextSpec(tuple(text), tuple(heldout), seq_len, calib_windows, heldout_windows, on_policy, prompt_len,
                        chat_prompts, answer_tokens)
        if eagle or draft_kind == "eagle":
            if any(v is not None for v in (plan_file, layers, heads, ffn, hidden, depth_metric, draft_for)):
                raise CompressError("--eagle trains a head for TEACHER itself: --plan/--layers/--heads/--ffn/--hidden/"
                                    "--depth-metric/--draft-for do not apply")
            head = EagleConfig(eagle_coverage, eagle_hidden_weight, distill["kd_weight"], eagle_train_chain,
                               eagle_train_lm_head)
            path = compress_eagle(teacher, out, DistillConfig(**distill), head, spec, device, gguf_file,
                                  init_head=init_head)
            click.echo(f"engine-compress: wrote {path}")
            return
        if init_head is not None:
            raise CompressError("--init-head continues an EAGLE head: give --eagle too")
        plan = load_plan(plan_file, layers=layers, heads=heads, ffn=ffn, hidden=hidden, depth_metric=depth_metric)
        path = compress(teacher, out, plan, DistillConfig(**distill), spec, draft_for, device, gguf_file)
    except Interrupted as stop:
        click.echo(f"engine-compress: {stop}", err=True)
        sys.exit(130)
    except KeyboardInterrupt:  # before training started: nothing half-written (every save is a rename)
        click.echo("engine-compress: interrupted before training; nothing was written", err=True)
        sys.exit(130)
    except CompressError as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"engine-compress: wrote {path}")


if __name__ == "__main__":
    main()
