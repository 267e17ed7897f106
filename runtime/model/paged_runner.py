"""A paged engine (target.attention paged) driven step by step: the KV block pools live on the device as
ONNX Runtime OrtValues, bound as past_* and present_* (one memory, updated in place); each step packs every
sequence's new tokens into one row and feeds PagedAttention's layout (runtime/model/paged_inputs.py).

It is not yet the executor's runner (the scheduler's blocks come from runtime/batching/block_table.py
there); it serves the GPU check (tools/bench/gpu_check.paged_check) and tests/runtime/test_paged_gpu.py:
greedy tokens of a paged engine against its GQA twin and transformers."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from runtime.manifest.load import read_manifest
from runtime.model.kv_cache import ONNX_TYPES
from runtime.model.paged_inputs import paged_inputs
from runtime.model.rotary import rope_tables


class PagedRunner:
    """One session over a paged engine; `step` runs a packed batch and returns next-token logits per sequence."""

    def __init__(self, engine_dir: str | Path, device: str = "cuda"):
        self.manifest = read_manifest(Path(engine_dir))
        self.spec = self.manifest.kv_cache
        if self.spec.block_size is None:
            raise ValueError(f"{engine_dir} is not a paged engine (kv_cache.block_size is null)")
        provider = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}[device]
        self.session = ort.InferenceSession(str(Path(engine_dir) / "model.onnx"), providers=[provider])
        self.device = device
        element = ONNX_TYPES[self.spec.storage_dtype]
        self.pools = {f"{kind}_{layer}": ort.OrtValue.ortvalue_from_shape_and_type(
            list(self.spec.buffer_shape), element, device, 0)
            for layer in range(self.spec.num_layers) for kind in ("key", "value")}
        cos, sin = rope_tables(self.manifest.rope, self.spec.max_seq_len, self.spec.dtype)
        self.tables = {"cos_cache": cos, "sin_cache": sin}

    def step(self, blocks: Sequence[Sequence[int]], past_lens: Sequence[int],
             new_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Run every sequence's new tokens (packed); logits [sequences, vocab] at each one's last new token."""
        inputs = paged_inputs(blocks, past_lens, [len(ids) for ids in new_ids], self.spec.block_size,
                              max_blocks=-(-self.spec.max_seq_len // self.spec.block_size))
        packed = np.array([[t for ids in new_ids for t in ids]], np.int64)  # [1, tokens]
        last = inputs.cumulative_sequence_length[1:].astype(np.int64) - 1
        binding = self.session.io_binding()
        feeds = {"input_ids": packed, "logits_index": last, "top_k": np.ones(1, np.int64),  # top_k: the sampling head's
                 **self.tables, **inputs.feeds()}
        names = {i.name for i in self.session.get_inputs()}
        for name, array in feeds.items():
            if name in names:
                binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, pool in self.pools.items():
            binding.bind_ortvalue_input(f"past_{name}", pool)
            binding.bind_ortvalue_output(f"present_{name}", pool)
        binding.bind_output("logits", "cpu")
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    def greedy(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
        """Greedy continuations of `prompts` run together: a prefill step, then one decode step per token.
        Sequence i holds its own run of blocks (ids i * per_sequence ...), enough for prompt + new tokens."""
        per_sequence = -(-self.spec.max_seq_len // self.spec.block_size)
        if len(prompts) * per_sequence > self.spec.num_blocks:
            raise ValueError(f"{len(prompts)} sequences need more than the pool's {self.spec.num_blocks} blocks")
        blocks = [list(range(i * per_sequence, (i + 1) * per_sequence)) for i in range(len(prompts))]
        past, new = [0] * len(prompts), [list(p) for p in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        for _ in range(new_tokens):
            picks = self.step(blocks, past, new).argmax(-1)
            past = [p + len(n) for p, n in zip(past, new)]
            new = [[int(t)] for t in picks]
            for row, token in zip(out, picks):
                row.append(int(token))
        return out
