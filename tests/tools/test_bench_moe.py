"""tools/bench/moe.py: parameter counts and expert load of a mixture-of-experts checkpoint."""
from __future__ import annotations

from tools.bench.moe import expert_load, parameter_counts
from tools.checkpoints.make_checkpoint import make_checkpoint

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def test_active_parameters_and_expert_load(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", family="qwen3_moe", hidden_size=64, num_layers=2, head_dim=16,
                                 vocab_size=320, moe=MOE, initializer_range=0.2)
    counts = parameter_counts(checkpoint)
    experts = 2 * 8 * 3 * 64 * 32  # layers x experts x (gate, up, down) x hidden x expert size
    assert counts["total"] - counts["active_per_token"] == experts * 6 // 8 + 320 * 64 - 64  # 6 of 8 experts idle
    one, many = expert_load(checkpoint, (1, 16))
    assert one == {"batch": 1, "distinct_experts_per_layer": 2.0, "expert_bytes_vs_batch_1": 1.0,
                   "busiest_over_mean_load": 1.0}
    assert 2.0 < many["distinct_experts_per_layer"] <= 8 and many["busiest_over_mean_load"] >= 1.0
