"""AppendHiddenOutput (an EAGLE head's feature): Before/After on a small inline IR, and the pipeline lists it
only for a recipe whose speculative.draft_model is an EAGLE head folder."""
from __future__ import annotations

import pytest

from builder.passes.append_hidden_output import OUTPUT, AppendHiddenOutput, HiddenOutputError
from builder.pipeline import pipeline
from builder.recipe import load_recipe
from tests.builder.test_sampling_head import head_graph


def test_the_lm_heads_input_becomes_the_hidden_states_output():
    before = head_graph(inner=True)
    gather = next(n for n in before.nodes if n.op == "GatherTokens")
    after = AppendHiddenOutput().run(before)
    assert [o.name for o in after.outputs] == ["logits", OUTPUT]
    assert after.values[OUTPUT].shape == ("num_logits", 8) and len(after.nodes) == len(before.nodes)
    lm_head = next(n for n in after.nodes if n.outputs == ["logits"])
    assert lm_head.inputs[0] == OUTPUT  # the same value, renamed: no copy in the graph
    assert gather.outputs[0] in before.values and gather.outputs[0] not in after.values  # the input is unchanged


def test_a_graph_without_gathered_tokens_is_refused():
    g = head_graph()
    g.nodes = [n for n in g.nodes if n.op != "GatherTokens"]
    with pytest.raises(HiddenOutputError, match="needs one GatherTokens node, it has 0"):
        AppendHiddenOutput().run(g)


def test_pipeline_lists_it_for_an_eagle_head_only(tmp_path):
    def names(recipe):
        return {(p.name, type(p).__name__) for phase in pipeline(recipe) for p in phase.passes}

    (tmp_path / "eagle.json").write_text("{}")
    with_head = load_recipe(base={"model": "m", "speculative": {"draft_model": str(tmp_path)}})
    plain = load_recipe(base={"model": "m"})
    assert ("append_hidden_output", "AppendHiddenOutput") in names(with_head)
    assert ("append_hidden_output", "Disabled") in names(plain)
