"""AppendSamplingHead: add ArgMax and TopK over the vocabulary of the `logits` output as graph
outputs, so a greedy step reads token ids and a sampling step reads k candidates, not the logits.

TopK's k is a graph input (`top_k`, int64 [1], read on the host): ONNX Runtime runs every node whatever a
call fetches (`only_execute_path_to_fetches` works in training builds only), so a call that reads next_token
or the logits passes k = 1 and does not pay for max_top_k candidates; a sampling call passes max_top_k."""
from __future__ import annotations

from builder.ir import Graph, Value
from builder.pass_manager import Pass
from runtime.manifest.types import SamplingHead


class SamplingHeadError(ValueError):
    """The graph has no [num_logits, vocab] float32 `logits` output to sample from."""


class AppendSamplingHead(Pass):
    """Outputs `next_token` int64 [num_logits], `topk_values` float32 [num_logits, top_k] and
    `topk_indices` int64 [num_logits, top_k] for the input `top_k` (1..k, k = min(max_top_k, vocab));
    `logits` stays an output.
    Records graph.meta.sampling_head = SamplingHead(max_top_k=k)."""

    name = "append_sampling_head"

    def __init__(self, max_top_k: int):
        self.max_top_k = max_top_k

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        logits = self._logits(g)
        rows, vocab = logits.shape  # [num_logits, vocab]
        k = min(self.max_top_k, int(vocab))
        g.make("ArgMax", [logits.name], (rows,), "int64", out="next_token")
        top_k = g.add_input("top_k", (1,), "int64")
        g.add_node("TopK", [logits.name, top_k], [Value("topk_values", (rows, "top_k"), "float32"),
                                                  Value("topk_indices", (rows, "top_k"), "int64")])
        for name in ("next_token", "topk_values", "topk_indices"):
            g.add_output(name)
        g.meta.sampling_head = SamplingHead(max_top_k=k)
        return g

    @staticmethod
    def _logits(g: Graph):
        found = [o for o in g.outputs if o.name == "logits"]
        if not found or len(found[0].shape) != 2 or found[0].dtype != "float32":
            outs = [(o.name, o.text()) for o in g.outputs]
            raise SamplingHeadError(f"the sampling head needs a float32 [num_logits, vocab] output 'logits'; "
                                    f"the graph's outputs are {outs}")
        if any(o.name == "next_token" for o in g.outputs):
            raise SamplingHeadError("the graph already has a sampling head (output 'next_token')")
        return found[0]

