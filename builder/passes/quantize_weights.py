"""QuantizeWeights: Linear(x, W, bias?) -> QuantLinear(x, q, scales, zero_points?, bias?) for every
weight the recipe's QuantizeMapping selects, Embedding(ids, W) -> QuantEmbedding(ids, q, scales)
where a tied embedding shares that weight, and MoE -> QuantMoE with symmetric quantized experts (router
float; builder/quant/experts.py); the float weight is replaced by its lazy quantized parts.
graph.meta.quantization records the scheme, the quantized weights and why the others stay float."""
from __future__ import annotations

import dataclasses

from builder.ir import Graph, Node
from builder.pass_manager import Pass
from builder.quant import DEFAULT_ACCURACY_LEVEL, QuantOptions, QuantTarget, plan_quantization, scheme_for
from builder.quant.experts import ExpertQuantizer, ImportedExperts, expert_block, stored_layout
from builder.quant.kernels import KernelTable
from builder.quant.levels import AccuracyLevels, ActivationBlocks, layer_kind
from builder.quant.plan import lm_head_weight
from builder.quant.weights import QuantizedWeight
from runtime.manifest.types import QuantizationRecord


class QuantizeWeights(Pass):
    """Weight-only quantization to MatMulNBits. `device` picks the default accuracy_level (cpu: 4);
    `options.accuracy_level` may set it per layer kind, or `auto` per matmul from this CPU's kernel table
    (builder/quant/levels.py, builder/quant/kernels.py); `options.activation_block` re-blocks, exactly, the
    matmuls with int8 activations whose stored blocks it divides, so their activations round per that many values."""

    name = "quantize_weights"

    def __init__(self, options: QuantOptions, device: str = "cpu"):
        self.options = options
        self.levels = AccuracyLevels.from_setting(options.accuracy_level, DEFAULT_ACCURACY_LEVEL[device])
        self.accuracy_level = self.levels.default
        self.blocks = ActivationBlocks.from_setting(options.activation_block)

    def run(self, graph: Graph) -> Graph:
        g = graph.copy()
        mapping = plan_quantization(g, self.options)
        head = lm_head_weight(g)
        kinds = {name: layer_kind(name, name == head) for name in mapping.targets}
        present = set(kinds.values()) | ({"experts"} if any(g.nodes_of("MoE")) else set())
        self.levels.check_kinds(present)
        self.blocks.check_kinds(present)
        table = KernelTable.for_this_cpu() if self.levels.auto else None
        matmuls = {}
        for name, target in mapping.targets.items():
            attrs = target.attrs(0)
            matmuls[name] = self.levels.choose(kinds[name], attrs["bits"], attrs["block_size"], table)
            level = matmuls[name]["level"]
            run = self.blocks.run_block(kinds[name], attrs["bits"], target.block, level)
            if run is not None:  # the same values in smaller blocks: int8 activations round per `run` values
                target = mapping.targets[name] = dataclasses.replace(target, run_block=run)
                matmuls[name]["activation_block"] = run
                matmuls[name]["why"] += f"; int8 activations in blocks of {run} by quantization.activation_block"
            parts = {part: g.add_weight(f"{name}.{part}", source)
                     for part, source in target.sources(g.weights[name]).items()}
            for node in g.nodes_of("Linear"):
                if node.inputs[1] == name:
                    self._rewrite(node, target, parts, level)
            for node in g.nodes_of("Embedding"):
                if node.inputs[1] == name:  # a tied embedding reads the same bytes by row
                    node.op, node.inputs = "QuantEmbedding", [node.inputs[0], parts["q"], parts["scales"]]
                    scale = {"scale": node.attrs["scale"]} if node.attrs.get("scale", 1.0) != 1.0 else {}  # Gemma
                    node.attrs = {**{key: target.attrs(0)[key] for key in ("bits", "block_size", "K")}, **scale}
            del g.weights[name], g.values[name]
        experts = {node.name: self._import_experts(g, node) if mapping.source else self._quantize_experts(g, node)
                   for node in list(g.nodes_of("MoE"))}
        record = dict(mapping.record(self.levels.record(present, matmuls)), **_awq_record(g), **({"experts": experts} if experts else {}))
        g.meta.quantization = QuantizationRecord(record.pop("mode"), record)
        return g

    def _quantize_experts(self, g: Graph, node: Node) -> dict:
        """MoE(x, router, gate_up, down, biases...) -> QuantMoE(x, router, q, scales, q, scales, biases...)."""
        scheme = scheme_for(self.options)
        x, router, gate_up, down = node.inputs[:4]
        _, hidden, inter = g.weights[down].shape  # down [E, H, I]
        level = self.levels.level("experts")
        block = expert_block(scheme, hidden, inter, level)
        parts = []
        for name in (gate_up, down):
            quantizer = ExpertQuantizer(g.weights[name], scheme.bits, block)
            parts += [g.add_weight(f"{name}.{part}", QuantizedWeight(quantizer, part)) for part in ("q", "scales")]
            del g.weights[name], g.values[name]
        node.op, node.inputs = "QuantMoE", [x, router] + parts + node.inputs[4:]
        node.attrs = dict(node.attrs, bits=scheme.bits, block_size=block, accuracy_level=level)
        return {"bits": scheme.bits, "block_size": block, "router": "float"}

    def _import_experts(self, g: Graph, node: Node) -> dict:
        """A pre-quantized checkpoint's MoE: QuantMoE over the stored integers where QMoE reads them exactly
        (builder/quant/experts.py stored_layout); else kept float, the stored values dequantized exactly."""
        gate_up, down = node.inputs[2:4]
        layout = stored_layout([g.weights[gate_up], g.weights[down]])
        level = self.levels.level("experts")
        if layout is None:
            return {"router": "float", "experts": "float: stored float or MXFP4 (no CPU kernel), or in blocks with "
                                                  "a float minimum QMoE has no input for (dequantized exactly)"}
        bits, block = layout
        if bits == 8 and level == 0:  # QMoE's 8-bit block kernels quantize activations whatever the level
            return {"router": "float", "experts": f"float: stored 8-bit in blocks of {block}, which QMoE computes "
                                                  f"with int8 activations; accuracy_level 0 asks for float ones "
                                                  f"(dequantized exactly)"}
        parts = []
        for name in (gate_up, down):
            imported = ImportedExperts(g.weights[name], bits, block)
            parts += [g.add_weight(f"{name}.{part}", QuantizedWeight(imported, part)) for part in ("q", "scales")]
            del g.weights[name], g.values[name]
        node.op, node.inputs = "QuantMoE", [node.inputs[0], node.inputs[1]] + parts + node.inputs[4:]
        node.attrs = dict(node.attrs, bits=bits, block_size=block, accuracy_level=level)
        return {"bits": bits, "block_size": block, "router": "float",
                "experts": f"QMoE over the checkpoint's own integers ({bits}-bit, blocks of {block})"}

    def _rewrite(self, node: Node, target: QuantTarget, parts: dict[str, str], level: int) -> None:
        bias = node.inputs[2] if len(node.inputs) == 3 else ""
        inputs = [node.inputs[0], parts["q"], parts["scales"], parts.get("zero_points", ""), bias]
        while not inputs[-1]:
            inputs.pop()
        node.op, node.inputs, node.attrs = "QuantLinear", inputs, target.attrs(level)


def _awq_record(g: Graph) -> dict:
    """What the calibration passes before this one recorded (SearchAWQScales, SolveGPTQ)."""
    return {key: getattr(g.meta, key) for key in ("awq", "gptq") if getattr(g.meta, key) is not None}
