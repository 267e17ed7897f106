"""EAGLE head training on a tiny random Llama, fast: the chain positions the loss trains (the training-time test),
the frozen draft lm_head, and evaluate_head's chain bookkeeping against heads whose answers are known."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from builder.compress.data import chat_markup, reply_mask, window_replies, windows
from builder.compress.eagle import CHAIN, EagleConfig, EagleHead, evaluate_head, head_loss, target_features
from builder.compress.plan import CompressError


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def _window(target, seq: int = 12):
    ids = torch.randint(0, 96, (2, seq + 1))
    with torch.no_grad():
        return ids, target.model(input_ids=ids).last_hidden_state


def test_the_loss_trains_each_chain_position(target):
    head = EagleHead(target, torch.arange(0, 96, 2))
    ids, features = _window(target)
    full = target.get_output_embeddings().weight.detach()[head.draft_ids]
    losses = [head_loss(head, full, ids, features, EagleConfig(train_chain=n))[0] for n in (1, 2, 3)]
    assert losses[0] < losses[1] < losses[2]  # each added pass adds its (positive) loss
    losses[2].backward()
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0


def test_a_frozen_lm_head_keeps_the_targets_rows(target):
    draft_ids = torch.arange(0, 96, 3)
    head = EagleHead(target, draft_ids, train_lm_head=False)
    ids, features = _window(target)
    full = target.get_output_embeddings().weight.detach()
    head_loss(head, full[draft_ids], ids, features, EagleConfig())[0].backward()
    assert head.lm_head.weight.grad is None and torch.equal(head.lm_head.weight, full[draft_ids])
    assert head.layer.mlp.down_proj.weight.grad is not None


def test_the_chain_length_is_checked():
    with pytest.raises(CompressError, match="--eagle-train-chain is 1, 2 or 3"):
        EagleConfig(train_chain=4)


class _Oracle(torch.nn.Module):
    """Answers with twice the true next features (the target's argmax, told apart from its features when fed back);
    `first_only`: only when fed the target's own features (a chain's first step), else with their negation."""

    def __init__(self, features: torch.Tensor, lm_head: torch.Tensor, first_only: bool):
        super().__init__()
        self.features, self.first_only = features, first_only
        self.register_buffer("draft_ids", torch.arange(lm_head.shape[0]))
        self.lm_head = lm_head

    def forward(self, ids, fed):
        truth = 2 * self.features[:, 1:]
        if self.first_only and not torch.equal(fed, self.features[:, :-1]):
            truth = -truth
        return truth, truth @ self.lm_head.T


def test_evaluate_head_scores_each_chain_step_given_the_steps_before(target):
    ids, features = _window(target)
    full = target.get_output_embeddings().weight.detach()
    always = evaluate_head(_Oracle(features, full, False), full, ids, features)
    assert [always[f"accept_{n + 1}"] for n in range(CHAIN)] == [1.0] * CHAIN
    assert always["accepted_length_3"] == 4.0
    first = evaluate_head(_Oracle(features, full, True), full, ids, features)
    assert first["accept_1"] == 1.0 and first["accept_2"] == 0.0 and first["accepted_length_3"] == 2.0


class _Stops:
    """The target's `.model`, counting calls and raising KeyboardInterrupt at call `stop_at`."""

    def __init__(self, target, stop_at: int | None = None):
        self.target, self.stop_at, self.calls = target, stop_at, 0

    @property
    def model(self):
        return self

    def __call__(self, **kwargs):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return self.target.model(**kwargs)


def test_an_interrupted_feature_pass_resumes_after_its_last_save(target, tmp_path):
    rows = torch.randint(0, 96, (7, 9))  # batches of 2: 4, the last short
    path = tmp_path / "features.pt"
    with pytest.raises(KeyboardInterrupt):
        target_features(_Stops(target, stop_at=3), rows, path, batch_size=2, save_every=1)
    resumed = _Stops(target)
    features = target_features(resumed, rows, path, batch_size=2, save_every=1)
    assert resumed.calls == 2  # batches 3 and 4; 1 and 2 were saved
    with torch.no_grad():
        torch.testing.assert_close(features, target.model(input_ids=rows).last_hidden_state.half().float())
    again = _Stops(target)
    assert torch.equal(target_features(again, rows, path, batch_size=2), features) and again.calls == 0


def test_evaluate_head_scores_only_the_drafts_the_engine_makes_in_replies(target):
    """With `replies` (the engine drafts a reply's tokens, never the template's or the prompt's) a chain step counts
    where it starts at a reply token and predicts one: here the reply is tokens 5..12 of each 13-token window."""
    ids, features = _window(target)
    full = target.get_output_embeddings().weight.detach()
    replies = torch.arange(ids.shape[1])[None].expand(2, -1) >= 5
    scored = evaluate_head(_Oracle(features, full, False), full, ids, features, replies=replies)
    # step 1 at t (t = 0..11) drafts token t + 2 from a chain rooted at t + 1: roots 5..12, 8 a row
    assert scored["scored"] == "replies" and scored["drafts_scored"] == 2 * 8
    assert scored["accept_1"] == scored["accept_2"] == scored["accept_3"] == 1.0
    assert evaluate_head(_Oracle(features, full, False), full, ids, features)["drafts_scored"] == 2 * 12


def test_replies_are_found_by_the_chat_templates_markup():
    header, start, ends = [7, 8], 1, {2}
    blank = lambda token: token == 9  # the newline a conversation writer puts between conversations
    stream = torch.tensor([1, 5, 5, 2, 1, 7, 8, 30, 31, 2, 9, 1, 5, 2, 1, 7, 8, 40, 41, 9, 1, 5, 7, 8, 50])
    #                      system/user ..|  reply 30 31 <end> | next conversation | reply cut short, then a blank
    mask = reply_mask(stream, header, start, ends, blank)
    assert stream[mask].tolist() == [30, 31, 2, 40, 41, 50]


def test_reply_windows_follow_the_stream_across_window_cuts():
    """The replies are found over the stream the windows were cut from (a window may start mid-reply), from the
    chat template's own markup (the trained target's: replies open with `def `, end with the end-of-text token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "checkpoints" / "trained" / "target")
    markup = chat_markup(tokenizer)
    assert markup is not None
    reply = tokenizer("return x + 1", add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    ids = torch.tensor([markup[1], 6] + markup[0] + reply + [eos, markup[1], 6, 6] + markup[0] + reply + [eos, 6])
    rows = windows(ids, 4)  # 5 tokens each, every one sharing its first with the one before's last
    mask = window_replies(rows, tokenizer)
    flat = torch.cat([mask[0], mask[1:, 1:].reshape(-1)])
    stream = ids[:flat.numel()]
    assert stream[flat].tolist() == (reply + [eos] + reply + [eos])[:int(flat.sum())]
    assert int(flat.sum()) >= 2 * len(reply)
