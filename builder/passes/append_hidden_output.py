"""AppendHiddenOutput: the target's last hidden state (after the final norm: what its lm_head reads) as the graph
output `hidden_states` [num_hidden, hidden], gathered at positions of its own (the input `hidden_index`), for an
EAGLE draft head (builder/eagle_head.py) to draft from. Its own index, not the logits': a prompt chunk returns the
features of every position and the logits of its last only, and a call that wants no features passes an empty
index (a Gather of no rows: nothing computed, nothing copied)."""
from __future__ import annotations

from builder.ir import Graph
from builder.pass_manager import Pass

OUTPUT = "hidden_states"
INDEX = "hidden_index"


class HiddenOutputError(ValueError):
    """The graph has no GatherTokens feeding its logits to read the hidden state from."""


class AppendHiddenOutput(Pass):
    """Adds the input `hidden_index` int64 [num_hidden] (flat token positions, as logits_index) and the output
    `hidden_states` float32 [num_hidden, hidden]: the lm_head's input (what the logits' GatherTokens reads) at
    those positions."""

    name = "append_hidden_output"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        gathered = [n for n in g.nodes if n.op == "GatherTokens"]
        if len(gathered) != 1:
            raise HiddenOutputError(f"an EAGLE head reads the hidden state the lm_head reads: the graph needs one "
                                    f"GatherTokens node, it has {len(gathered)}")
        normed = gathered[0].inputs[0]  # [batch, seq, hidden]: every position, after the final norm
        hidden = g.values[normed].shape[-1]
        index = g.add_input(INDEX, ("num_hidden",), "int64")
        g.make("GatherTokens", [normed, index], ("num_hidden", hidden), g.values[normed].dtype, out=OUTPUT)
        g.add_output(OUTPUT)
        return g
