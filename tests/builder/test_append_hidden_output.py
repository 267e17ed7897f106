"""AppendHiddenOutput (an EAGLE head's feature): Before/After on a small inline IR, and the pipeline lists it
only for a recipe whose speculative.draft_model is an EAGLE head folder."""
from __future__ import annotations

import pytest

from builder.passes.append_hidden_output import INDEX, OUTPUT, AppendHiddenOutput, HiddenOutputError
from builder.pipeline import pipeline
from builder.recipe import load_recipe
from tests.builder.test_sampling_head import head_graph


def test_the_lm_heads_input_is_gathered_again_at_positions_of_its_own():
    before = head_graph(inner=True)
    gather = next(n for n in before.nodes if n.op == "GatherTokens")
    after = AppendHiddenOutput().run(before)
    assert [o.name for o in after.outputs] == ["logits", OUTPUT]
    assert [i.name for i in after.inputs][-1] == INDEX and after.values[INDEX].shape == ("num_hidden",)
    assert after.values[OUTPUT].shape == ("num_hidden", 8) and len(after.nodes) == len(before.nodes) + 1
    added = next(n for n in after.nodes if n.outputs == [OUTPUT])
    assert added.op == "GatherTokens" and added.inputs == [gather.inputs[0], INDEX]  # what the lm_head's gather reads
    lm_head = next(n for n in after.nodes if n.outputs == ["logits"])
    assert lm_head.inputs[0] == gather.outputs[0]  # the logits path is unchanged
    assert len(before.nodes) == len(after.nodes) - 1 and OUTPUT not in before.values  # the input graph is untouched


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
