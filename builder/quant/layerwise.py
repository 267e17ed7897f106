"""Run a transformers decoder one layer at a time on calibration sequences, so that each layer sees the
outputs of the layers before it as they are after quantization (GPTQ's sequential order).

The model is instantiated on the meta device; only the modules outside the decoder layers (embedding,
rotary tables, final norm; never an untied lm_head) and the one layer being processed hold real
float32 weights, read from the checkpoint's safetensors. The inputs of layer 0 are caught with a
pre-hook that stops the forward pass there; each layer then runs on the hidden states of all
calibration batches twice: once with `observe` hooks on its linears (to collect statistics), and
once, after `update` has rewritten its weights, to produce the next layer's inputs.

Memory: the embedding until layer 0's inputs are caught, then one layer at a time, and the hidden
states of the calibration text (sequences x seq_len x hidden x 4 bytes: 8 MiB for 4096 tokens at
hidden 2048)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from builder.quant.calibration import BATCH, CalibrationError
from builder.weights import Checkpoint

Observe = Callable[[str, np.ndarray], None]     # (module name, input rows [..., K])


class _Stop(Exception):
    pass


@dataclass
class LayerwiseModel:
    """A transformers causal LM with real weights only where it is running."""

    model_dir: Path

    def __post_init__(self) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(self.model_dir), local_files_only=True, trust_remote_code=False)
        config._attn_implementation = "sdpa"  # no mask given: sdpa applies the causal mask itself
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, trust_remote_code=False).eval()
        self.checkpoint = Checkpoint(self.model_dir)
        self.decoder = self.model.get_decoder()
        layers = getattr(self.decoder, "layers", None)
        if layers is None:
            raise CalibrationError(f"{type(self.model).__name__}: no decoder `layers` list to run layer by layer")
        self.layers = layers
        self.prefix = next(name for name, module in self.model.named_modules() if module is layers)
        self._init_buffers(skip=layers)
        self._load(self.decoder, self._name_of(self.decoder), skip=(self.prefix + ".",))
        if hasattr(self.decoder, "rotary_emb"):  # its tables are computed at init, not stored
            self.decoder.rotary_emb = type(self.decoder.rotary_emb)(config=config)

    def _init_buffers(self, skip) -> None:
        """Buffers computed at init, not stored (Gemma 3's embed_scale), outside the layers: on the CPU, set by
        the model's own _init_weights (before the parameters are loaded, which it would overwrite)."""
        import torch

        inside = {id(m) for m in skip.modules()}
        for module in self.decoder.modules():
            meta = [name for name, b in module.named_buffers(recurse=False) if b.is_meta]
            if id(module) in inside or not meta:
                continue
            for name in meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            self.model._init_weights(module)

    def _name_of(self, module) -> str:
        return next(name for name, m in self.model.named_modules() if m is module)

    def _load(self, module, prefix: str, skip: tuple[str, ...] = ()) -> None:
        """Real weights for `module`'s parameters from the checkpoint (those not under `skip`)."""
        import torch

        for name, param in list(module.named_parameters()):
            key = f"{prefix}.{name}" if prefix else name
            if key.startswith(skip):
                continue
            if key not in self.checkpoint.names():
                raise CalibrationError(f"{self.model_dir}: tensor {key!r} is not in the checkpoint")
            owner, _, leaf = name.rpartition(".")
            parent = module.get_submodule(owner) if owner else module
            value = torch.from_numpy(self.checkpoint.read(key))
            setattr(parent, leaf, torch.nn.Parameter(value, requires_grad=False))

    def layer_inputs(self, sequences: list[list[int]]) -> list[tuple[object, dict]]:
        """(hidden states, keyword arguments) of layer 0 for each batch of sequences."""
        import torch

        caught = []

        def catch(module, args, kwargs):
            caught.append((args[0], kwargs))
            raise _Stop

        handle = self.layers[0].register_forward_pre_hook(catch, with_kwargs=True)
        try:
            with torch.no_grad():
                for i in range(0, len(sequences), BATCH):
                    try:
                        self.decoder(input_ids=torch.tensor(sequences[i:i + BATCH]), use_cache=False)
                    except _Stop:
                        pass
        finally:
            handle.remove()
        self.model.get_input_embeddings().to("meta")  # no longer needed: frees vocab x hidden floats
        return caught

    def run_layer(self, index: int, batches: list[tuple[object, dict]], observe: Observe,
                  update: Callable[[str, object], None]) -> list[tuple[object, dict]]:
        """Run layer `index` on `batches` with `observe` hooks on its Linear modules (full names), call
        `update(layer prefix, layer module)`, and return its outputs as the next layer's batches."""
        import torch

        layer = self.layers[index]
        prefix = f"{self.prefix}.{index}"
        self._load(layer, prefix)
        hooks = [module.register_forward_pre_hook(_observer(f"{prefix}.{name}", observe))
                 for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)]
        try:
            self._forward(layer, batches)
        finally:
            for hook in hooks:
                hook.remove()
        update(prefix, layer)
        outputs = self._forward(layer, batches)
        layer.to("meta")  # frees this layer's weights
        return [(out, kwargs) for out, (_, kwargs) in zip(outputs, batches)]

    def final_hidden(self, batches: list[tuple[object, dict]]) -> list[np.ndarray]:
        """The final norm applied to the last layer's outputs: the lm_head's inputs."""
        import torch

        with torch.no_grad():
            return [self.decoder.norm(hidden).numpy() for hidden, _ in batches]

    @staticmethod
    def _forward(layer, batches) -> list:
        import torch

        with torch.no_grad():
            outs = [layer(hidden, **kwargs) for hidden, kwargs in batches]
        return [out[0] if isinstance(out, tuple) else out for out in outs]


def _observer(name: str, observe: Observe):
    def hook(module, args):
        observe(name, args[0].detach().float().numpy())
    return hook
