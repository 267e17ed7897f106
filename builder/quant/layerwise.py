"""Run a transformers decoder one layer at a time on calibration sequences, so that each layer sees the
outputs of the layers before it as they are after quantization (GPTQ's sequential order).

The model is instantiated on the meta device; only the modules outside the decoder layers (embedding,
rotary tables, final norm; never an untied lm_head) and the one layer being processed hold real
float32 weights, read from the checkpoint's safetensors. One pass of the decoder with every layer's forward
stood in for by a recorder (it returns its input) catches the inputs of layer 0 and the keyword arguments of
every layer: layers differ in them (Gemma 3's global layers take another rotary table and mask than its sliding
ones). Each layer then runs on the hidden states of all calibration batches twice: once with `observe` hooks on
its linears (to collect statistics), and once, after `update` has rewritten its weights, to produce the next
layer's inputs (once, with no `update`: AWQ's captures, capture_inputs).

Memory: the embedding until layer 0's inputs are caught, then one layer at a time, and the hidden
states of the calibration text (sequences x seq_len x hidden x 4 bytes: 8 MiB for 4096 tokens at
hidden 2048)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from builder.quant.calibration import BATCH, MAX_ROWS, Calibration, CalibrationError, block_gram, pair_envelope
from builder.weights import Checkpoint
from runtime.manifest.arith import ceil_div

Observe = Callable[[str, np.ndarray], None]     # (module name, input rows [..., K])


@dataclass
class LayerwiseModel:
    """A transformers causal LM with real weights only where it is running."""

    model_dir: Path

    def __post_init__(self) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(self.model_dir), local_files_only=True, trust_remote_code=False)
        config._attn_implementation = "sdpa"  # the masks layer_inputs records are built for sdpa
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, trust_remote_code=False).eval()
        self.checkpoint = Checkpoint(self.model_dir)
        self.decoder = self.model.get_decoder()
        layers = getattr(self.decoder, "layers", None)
        if layers is None:
            raise CalibrationError(f"{type(self.model).__name__}: no decoder `layers` list to run layer by layer")
        self.layers = layers
        self.prefix = next(name for name, module in self.model.named_modules() if module is layers)
        self.kwargs: list[list[dict]] = []  # [layer][batch]: each layer's keyword arguments (layer_inputs)
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

    def layer_inputs(self, sequences: list[list[int]]) -> list:
        """The hidden states entering layer 0, one tensor per batch of sequences; every layer's keyword arguments
        are kept for run_layer."""
        import torch

        hidden: list = []
        self.kwargs = [[] for _ in self.layers]

        def recorder(index: int):
            def forward(states, *args, **kwargs):
                if args:
                    raise CalibrationError(f"{type(self.layers[index]).__name__}: called with positional "
                                           f"arguments after the hidden states; cannot run it layer by layer")
                if index == 0:
                    hidden.append(states)
                self.kwargs[index].append(kwargs)
                return states
            return forward

        for index, layer in enumerate(self.layers):
            layer.forward = recorder(index)  # the instance's forward, called by Module.__call__
        try:
            with torch.no_grad():
                for i in range(0, len(sequences), BATCH):
                    self.decoder(input_ids=torch.tensor(sequences[i:i + BATCH]), use_cache=False)
        finally:
            for layer in self.layers:
                del layer.forward  # the class's forward again
        self.model.get_input_embeddings().to("meta")  # no longer needed: frees vocab x hidden floats
        return hidden

    def run_layer(self, index: int, hidden: list, observe: Observe,
                  update: Callable[[str, object], None] | None = None) -> list:
        """Run layer `index` on each batch's hidden states (with the layer's own keyword arguments) with `observe`
        hooks on its Linear modules (full names), call `update(layer prefix, layer module)` and run it again, and
        return its outputs: the next layer's hidden states. Without `update` the observed run's outputs."""
        import torch

        layer = self.layers[index]
        prefix = f"{self.prefix}.{index}"
        self._load(layer, prefix)
        hooks = [module.register_forward_pre_hook(_observer(f"{prefix}.{name}", observe))
                 for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)]
        try:
            outputs = self._forward(layer, hidden, self.kwargs[index])
        finally:
            for hook in hooks:
                hook.remove()
        if update is not None:
            update(prefix, layer)
            outputs = self._forward(layer, hidden, self.kwargs[index])
        layer.to("meta")  # frees this layer's weights
        return outputs

    def final_hidden(self, hidden: list) -> list[np.ndarray]:
        """The final norm applied to the last layer's outputs: the lm_head's inputs."""
        import torch

        with torch.no_grad():
            return [self.decoder.norm(states).numpy() for states in hidden]

    @staticmethod
    def _forward(layer, hidden: list, kwargs: list[dict]) -> list:
        import torch

        with torch.no_grad():
            outs = [layer(states, **own) for states, own in zip(hidden, kwargs)]
        return [out[0] if isinstance(out, tuple) else out for out in outs]


def _observer(name: str, observe: Observe):
    def hook(module, args):
        observe(name, args[0].detach().float().numpy())
    return hook


def capture_inputs(model_dir: Path, modules: dict[str, int], sequences: list[list[int]],
                   max_rows: int = MAX_ROWS, seed: int = 0) -> dict[str, Calibration]:
    """Module name -> its Calibration on `sequences` (AWQ's inputs), the float model run layer by layer, the Gram in
    blocks of modules[name] columns. Every row counts in the Gram: clip bounds chosen on a 512-row sample of a
    4k-token code text cost SmolLM2-135M two down projections whose output error on prose rose 36-41x (the
    sample over-fits rare large inputs); on all 4352 rows none rose (docs/ACCURACY.md, "AWQ on SmolLM2")."""
    runner = LayerwiseModel(Path(model_dir))
    hidden = runner.layer_inputs(sequences)
    rng = np.random.default_rng(seed)
    per_call = ceil_div(max_rows, len(hidden))
    rows: dict[str, list[np.ndarray]] = {name: [] for name in modules}
    grams: dict[str, np.ndarray] = {name: np.zeros(()) for name in modules}
    counts = dict.fromkeys(modules, 0)

    def observe(name: str, x: np.ndarray) -> None:
        if name not in modules:
            return
        x = x.reshape(-1, x.shape[-1])
        pick = rng.choice(len(x), size=min(per_call, len(x)), replace=False)
        rows[name].append(x[np.sort(pick)].copy())
        grams[name] = grams[name] + block_gram(x, modules[name])
        counts[name] += len(x)

    for index in range(len(runner.layers)):
        hidden = runner.run_layer(index, hidden, observe)
    missing = sorted(name for name, count in counts.items() if count == 0)
    if missing:
        raise CalibrationError(f"AWQ: no calibration inputs reached {missing} (not Linear modules of the decoder "
                               f"layers)")
    return {name: Calibration(np.concatenate(parts)[:max_rows], (grams[name] / counts[name]).astype(np.float32))
            for name, parts in rows.items()}


def capture_kv_extremes(model_dir: Path, sequences: list[list[int]], rotary_dim: int,
                        interleaved: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, (k_envelope, v_absmax), each float32 [kv_heads, head_dim], over `sequences` run through
    transformers layer by layer. K is read as attention reads it (after q/k norms and rotary); each rotary pair's
    channels both get the pair's largest norm sqrt(k_i^2 + k_j^2), which rotation leaves unchanged, so a scale
    taken from it bounds K at every position, not only at the calibrated ones. Channels past
    `rotary_dim` (partial rotary) and V take their largest |x|."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: dict[int, list[np.ndarray]] = {}

    def record(module, query, key, value, *args, **kwargs):  # key, value [batch, kv_heads, seq, head_dim]
        k = pair_envelope(key.detach().float().numpy(), rotary_dim, interleaved).max(axis=(0, 2))
        v = np.abs(value.detach().float().numpy()).max(axis=(0, 2))
        old = seen.get(module.layer_idx)
        seen[module.layer_idx] = [k, v] if old is None else [np.maximum(old[0], k), np.maximum(old[1], v)]
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    runner = LayerwiseModel(Path(model_dir))
    hidden = runner.layer_inputs(sequences)  # the masks made for sdpa, which `record` calls
    AttentionInterface.register("kv_calibration", record)
    runner.model.set_attn_implementation("kv_calibration")
    for index in range(len(runner.layers)):
        hidden = runner.run_layer(index, hidden, lambda name, x: None)
    return [(seen[layer][0].astype(np.float32), seen[layer][1].astype(np.float32)) for layer in sorted(seen)]
