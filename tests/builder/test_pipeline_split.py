"""The automatic pipeline split weighs each layer and the lm_head by its per-token compute, not its bytes
(builder/pipeline_stages.py `layer_costs`): on SmolLM2-135M's shapes (Q4_1 layers, a tied Q8_0 embedding read
whole as the lm_head, gathered one row a token as the embedding) the lm_head weighs ~6 layers by the AVX-512
kernel table, not the ~14 its bytes say, so pp2 cuts at layer 18 (bytes cut at 23); a uniform float model
(lm_head and embedding untied) by its multiply-adds; an MoE layer by the experts a token runs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from builder.ir import Graph
from builder.pipeline_stages import layer_costs, plan_stages, token_values
from builder.quant.kernels import KernelTable
from builder.weights import WeightSource

SMOLLM2_GGUF = Path(__file__).parents[2] / "checkpoints/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HIDDEN, FFN, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M


@dataclass(frozen=True)
class Packed(WeightSource):
    """A pre-quantized weight's shape, bits and block (what GGUF import gives the split), never read."""
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    bits: int | None = None
    block: int | None = None


def smollm2_like(bits: int | None = 4, head_bits: int | None = 8, tied: bool = True) -> Graph:
    g = Graph("smollm2-like")
    x = g.add_input("input_ids", ("batch", "seq"), "int64")
    g.add_weight("embed", Packed((VOCAB, HIDDEN), bits=head_bits, block=32 if head_bits else None))
    x = g.make("Embedding", [x, "embed"], ("batch", "seq", HIDDEN), "float32")
    for i in range(LAYERS):
        g.add_weight(f"layers.{i}.norm", Packed((HIDDEN,)))
        x = g.make("RMSNorm", [x, f"layers.{i}.norm"], ("batch", "seq", HIDDEN), "float32")
        for name, shape in (("q", (HIDDEN, HIDDEN)), ("k", (KV, HIDDEN)), ("v", (KV, HIDDEN)), ("o", (HIDDEN, HIDDEN)),
                            ("gate_up", (2 * FFN, HIDDEN)), ("down", (HIDDEN, FFN))):
            g.add_weight(f"layers.{i}.{name}", Packed(shape, bits=bits, block=32 if bits else None))
            x = g.make("Linear", [x, f"layers.{i}.{name}"], ("batch", "seq", shape[0]), "float32")
    g.add_weight("final_norm", Packed((HIDDEN,)))
    x = g.make("RMSNorm", [x, "final_norm"], ("batch", "seq", HIDDEN), "float32")
    head = "embed" if tied else g.add_weight("lm_head", Packed((VOCAB, HIDDEN), bits=head_bits,
                                                                block=32 if head_bits else None))
    g.add_output(g.make("Linear", [x, head], ("batch", "seq", VOCAB), "float32"))
    return g


def test_smollm2_q4_1_split_by_compute_not_bytes():
    """The AVX-512 table's figures per million weights at batch 1 (4-bit and 8-bit, block 32, each at its fastest
    level): a layer costs its 3.54M weights at the 4-bit figure, the Q8_0 lm_head its 28.3M at the 8-bit one, and
    the cut is where the two stages' costs are closest (by bytes the head weighed 13.6 layers, the cut 23)."""
    table = KernelTable.load("avx512")
    per_weight = {bits: table.time_us(bits, 32, table.fastest(bits, 32), 10**6) for bits in (4, 8)}
    costs, rest = layer_costs(smollm2_like(), LAYERS, table)
    assert rest / costs[0] == pytest.approx(VOCAB * HIDDEN * per_weight[8] / (3.538944e6 * per_weight[4]), rel=0.01)
    cut = min(range(1, LAYERS), key=lambda k: abs(sum(costs[:k]) - sum(costs[k:]) - rest))
    assert plan_stages(LAYERS, 2, None, costs, rest) == [(0, cut), (cut, LAYERS)] and cut < 23
    assert plan_stages(LAYERS, 2, [23, 7], costs, rest) == [(0, 23), (23, 30)]  # given still wins


def test_without_a_kernel_figure_the_split_weighs_multiply_adds():
    """No table for this CPU: a value is a value; the lm_head (28.3M) weighs 8 layers (3.54M each)."""
    costs, rest = layer_costs(smollm2_like(), LAYERS, KernelTable("none"))
    assert rest == pytest.approx(VOCAB * HIDDEN + HIDDEN)
    assert plan_stages(LAYERS, 2, None, costs, rest) == [(0, 19), (19, 30)]


def test_uniform_float_model_untied():
    """Float weights, an untied lm_head: the embedding is gathered (free), the head its multiply-adds."""
    g = smollm2_like(bits=None, head_bits=None, tied=False)
    values = token_values(g)
    assert "embed" not in values and values["lm_head"] == VOCAB * HIDDEN
    costs, rest = layer_costs(g, LAYERS, KernelTable.load("avx512"))
    assert len(set(costs)) == 1 and plan_stages(LAYERS, 3, None, costs, rest) == [(0, 13), (13, 26), (26, 30)]  # 13 / 13 / 4 + 8


def test_moe_experts_weigh_what_a_token_runs():
    g = Graph("moe")
    x = g.add_input("x", ("batch", "seq", 64), "float32")
    g.add_weight("layers.0.experts_gate_up", Packed((8, 64, 256)))
    g.add_weight("layers.0.experts_down", Packed((8, 128, 64)))
    g.add_weight("layers.0.router", Packed((8, 64)))
    g.make("MoE", [x, "layers.0.router", "layers.0.experts_gate_up", "layers.0.experts_down"], ("batch", "seq", 64),
           "float32", top_k=2)
    assert token_values(g) == {"layers.0.router": 512, "layers.0.experts_gate_up": 2 * 64 * 256,
                               "layers.0.experts_down": 2 * 128 * 64}


@pytest.mark.e2e
@pytest.mark.skipif(not SMOLLM2_GGUF.exists(), reason="the SmolLM2 GGUF file is fetched on the dev machine only; "
                                                    "test_smollm2_q4_1_split_by_compute_not_bytes covers its shapes")
def test_the_real_smollm2_file_splits_by_compute():
    from builder.gguf.checkpoint import staged_recipe
    from builder.recipe import load_recipe
    from builder.trace import trace

    graph = trace(staged_recipe(load_recipe(base={"model": str(SMOLLM2_GGUF)}), lambda _: None).model)
    costs, rest = layer_costs(graph, LAYERS, KernelTable.load("avx512"))
    # measured (docs/BENCHMARKS.md, "Pipeline parallelism"): at [0, 18) stage 0 computed 4.45 s and stage 1 4.13 s,
    # so the balanced cut is 17-18; the table counts the linears only (not the block-minimum term nor the small
    # nodes), which puts it at 20 with the quiet table (18 with the contended one): by bytes it was 23
    ((_, cut), _) = plan_stages(LAYERS, 2, None, costs, rest)
    assert 17 <= cut <= 20
