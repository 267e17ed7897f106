"""AddLoRA: each targeted Linear gets `y += (x @ A[id]) @ B[id]` per token, where A [in, max_adapters * r] and
B [max_adapters * r, out] are graph inputs the runtime fills with its loaded adapters (slot s >= 1 in rank block
s - 1; slot 0, no block, is the base model) and `lora_ids` int64 [batch, seq] says each token's slot. A fused projection (qkv, gate_up) takes its modules'
adapters side by side: A concatenated along the rank, B block-diagonal. Runs after the fusions, before
quantization (a QuantLinear keeps its LoRA node)."""
from __future__ import annotations

import re
from typing import Callable

from builder.ir import Graph, Node
from builder.pass_manager import Pass
from runtime.manifest.types import Lora, LoraLinear

FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}  # a fusion's weight suffix -> its parts' IR keys
LAYER_WEIGHT = re.compile(r"^layers\.(\d+)\.(\w+)$")
IDS = "lora_ids"


class LoraError(ValueError):
    """A LoRA target the family has no linear for."""


class AddLoRA(Pass):
    """Records graph.meta.lora (runtime/manifest/types.py `Lora`) with every linear it adapted."""

    name = "add_lora"

    def __init__(self, max_rank: int, max_adapters: int, targets: list[str],
                 module_names: Callable[[str], dict[str, str]]):
        """`module_names(family)`: IR layer weight key -> its HF module's short name (q -> q_proj) for the family's
        linear weights (builder/spec.py `linear_modules`, handed in: a pass reads no family spec itself)."""
        self.max_rank, self.slots, self.targets = max_rank, max_adapters + 1, tuple(targets)
        self.module_names = module_names

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        module_of = self.module_names(g.meta.family)  # IR key -> module name (q -> q_proj)
        known = sorted(set(module_of.values()))
        unknown = [t for t in self.targets if t not in known]
        if unknown:
            raise LoraError(f"lora.targets: {unknown} are not linear layers of the {g.meta.family} family; "
                            f"allowed: {known}")
        ids = g.add_input(IDS, ("batch", "seq"), "int64")
        linears = []
        for node in [n for n in g.nodes if n.op == "Linear"]:
            found = LAYER_WEIGHT.match(node.inputs[1])
            if not found:
                continue  # lm_head, embeddings: never adapted
            layer, key = int(found[1]), found[2]
            modules = tuple(module_of.get(k, "") for k in FUSED.get(key, (key,)))
            if any(m in self.targets for m in modules):
                linears.append(self._adapt(g, node, layer, modules, ids))
        g.meta.lora = Lora(max_rank=self.max_rank, max_adapters=self.slots - 1, targets=self.targets,
                           ids=IDS, linears=tuple(linears))
        return g

    def _adapt(self, g: Graph, node: Node, layer: int, modules: tuple[str, ...], ids: str) -> LoraLinear:
        """Add `node`'s LoRA inputs and delta, and make its consumers read the sum."""
        source = g.weights[node.inputs[1]]
        widths = tuple(p.shape[0] for p in source.parts) if len(modules) > 1 else (source.shape[0],)
        out, inp = source.shape
        name = node.inputs[1]
        rank = self.max_rank * len(modules)
        adapters = self.slots - 1
        a = g.add_input(f"lora_a.{name}", (inp, adapters * rank), "float32")
        b = g.add_input(f"lora_b.{name}", (adapters * rank, out), "float32")
        y = g.values[node.outputs[0]]
        total = g.make("LoRA", [node.inputs[0], y.name, a, b, ids], y.shape, y.dtype, f"lora.{name}")
        added = g.nodes[-1:]
        for user in g.nodes[:-1]:
            user.inputs = [total if i == y.name else i for i in user.inputs]
        g.outputs = [g.values[total] if o.name == y.name else o for o in g.outputs]
        _move_after(g, node, added)
        return LoraLinear(layer=layer, a=a, b=b, modules=modules, widths=widths, in_features=int(inp))


def _move_after(g: Graph, node: Node, added: list[Node]) -> None:
    """Put the just-appended `added` nodes right after `node` (the list stays in topological order)."""
    g.nodes = [n for n in g.nodes if n not in added]
    at = g.nodes.index(node) + 1
    g.nodes[at:at] = added
