"""AppendHiddenOutput: the target's last hidden state (after the final norm: what its lm_head reads) at the
logits' positions, as the graph output `hidden_states` [num_logits, hidden], for an EAGLE draft head
(builder/eagle_head.py) to draft from. A call that does not bind the output does not fetch it."""
from __future__ import annotations

import dataclasses

from builder.ir import Graph
from builder.pass_manager import Pass

OUTPUT = "hidden_states"


class HiddenOutputError(ValueError):
    """The graph has no GatherTokens feeding its logits to read the hidden state from."""


class AppendHiddenOutput(Pass):
    """Outputs `hidden_states` float32 [num_logits, hidden], the input of the lm_head (GatherTokens' output)."""

    name = "append_hidden_output"

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        gathered = [n for n in g.nodes if n.op == "GatherTokens"]
        if len(gathered) != 1:
            raise HiddenOutputError(f"an EAGLE head reads the hidden state the lm_head reads: the graph needs one "
                                    f"GatherTokens node, it has {len(gathered)}")
        old = gathered[0].outputs[0]  # renamed: the value itself becomes the output, no copy in the graph
        g.values[OUTPUT] = dataclasses.replace(g.values.pop(old), name=OUTPUT)
        gathered[0].outputs[0] = OUTPUT
        for node in g.nodes:
            node.inputs = [OUTPUT if name == old else name for name in node.inputs]
        g.add_output(OUTPUT)
        return g
