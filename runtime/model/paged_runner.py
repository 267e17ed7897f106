"""A paged engine (target.attention paged: ONNX Runtime's PagedAttention, CUDA only) run by the same executor
and scheduler as a GQA engine. Its KV cache is one block pool per layer's key and value, and the block ids
are the scheduler's (runtime/batching/block_pool.py): each call is handed every row's block table
(`PagedRow`, made by the scheduler's runtime/batching/paged_table.py) and writes each new token's K/V to the
slot its block names, except where a shared cached block already holds it (runtime/model/paged_inputs.py).

A call packs the new tokens of every sequence it runs into one row, with no padding, so decode rows of any
lengths and prompt chunks go in one call and nothing rides along. A verify call writes every draft token's
K/V: the ones rejected land in the sequence's own tail blocks, past what it has cached (never shared: only
full, computed blocks are), and the next call overwrites them, so they need no slot_mapping -1."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from runtime.manifest.arith import ceil_div
from runtime.config import LoadConfig
from runtime.manifest.kv_spec import KVCacheSpec
from runtime.manifest.load import EngineError, Manifest, check_graph
from runtime.model.device import open_session, providers
from runtime.model.kv_cache import ONNX_TYPES, device_buffer
from runtime.model.model_runner import rotary_values
from runtime.model.ort_session import session_options
from runtime.model.weight_kernels import configure
from runtime.model.paged_inputs import PagedRow, paged_inputs
from runtime.model.runner import EngineRunner


class PagedKVCache:
    """Per layer a key and a value pool [num_blocks, block_size, kv_heads, head_dim] on the device, updated
    in place; the scheduler's BlockPool (runtime/batching/block_pool.py) hands out its block ids."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str):
        self.spec, self.device, self.num_blocks = spec, device, num_blocks
        self.shape = (num_blocks, spec.block_size, spec.kv_heads, spec.head_dim)
        self.pools = {f"{kind}_{layer}": device_buffer(self.shape, spec.storage_dtype, device)
                      for layer in range(spec.num_layers) for kind in ("key", "value")}

    def bind(self, binding: ort.IOBinding) -> None:
        """Every pool as past_* and present_* (one memory)."""
        element = ONNX_TYPES[self.spec.storage_dtype]
        for name, pool in self.pools.items():
            for bind, prefix in ((binding.bind_input, "past"), (binding.bind_output, "present")):
                bind(f"{prefix}_{name}", self.device, 0, element, list(self.shape), pool.data_ptr())


def open_paged_session(path: Path, manifest: Manifest, config: LoadConfig, spinning: bool) -> ort.InferenceSession:
    """The engine's session on CUDA; refused elsewhere (PagedAttention has no CPU kernel)."""
    if config.device != "cuda":
        raise EngineError(f"{path.parent} was built with target.attention paged (PagedAttention), which ONNX Runtime "
                          f"runs only on CUDA: load it with device 'cuda', or rebuild it with engine-build --set "
                          f"target.attention=gqa")
    options = session_options(config.threads, spinning)
    configure(options, config.weight_kernels, manifest.target.weight_kernels, "cuda")
    return open_session(path, options, providers(manifest, "cuda"))


class PagedModelRunner(EngineRunner):
    """Runs packed calls of a paged engine: `step` (any rows' new tokens in one call: decode rows and prompt
    chunks together) and `extend` (a prompt chunk or a verify on one row). Each row comes with its block table
    (`PagedRow`). `num_blocks`: the pool, the KV budget's blocks."""

    scores_prompts = False  # prompt chunks ride in packed calls, which read each row's last logits only

    def __init__(self, engine_dir: Path, manifest: Manifest, spec: KVCacheSpec, config: LoadConfig, num_blocks: int,
                 spinning: bool = True):
        self.session = open_paged_session(engine_dir / "model.onnx", manifest, config, spinning)
        check_graph(manifest, self.session.get_inputs(), self.session.get_outputs())  # runtime/manifest/load.py
        self.input_names = {i.name for i in self.session.get_inputs()}
        super().__init__(engine_dir, manifest, spec, PagedKVCache(spec, num_blocks, config.device))
        self.tables = rotary_values(manifest, spec, config.device)
        outputs = {o.name for o in self.session.get_outputs()}
        self.has_next_token = "next_token" in outputs
        self.top_k = manifest.sampling_head.max_top_k if "topk_values" in outputs else 0
        self.max_blocks = ceil_div(spec.max_seq_len, spec.block_size)  # the block table's fixed width
        self.new_call_shapes = 0  # packed calls bind afresh each time: none is slower for its shape

    def extend(self, row: PagedRow, past_len: int, tokens: list[int], all_logits: bool = False,
               head: str = "logits", features: bool = False) -> np.ndarray:
        """Append `tokens` to one row that holds `past_len` tokens: outputs per `head` of every new token, or of
        the last (Runner.extend's; no `features`: a paged engine has no EAGLE output, has_hidden is False)."""
        if features:
            raise ValueError("a paged engine has no hidden_states output for an EAGLE head")
        return self.step([row], [past_len], [tokens], head, all_logits)

    def step(self, rows: Sequence[PagedRow], past_lens: Sequence[int], new_ids: Sequence[Sequence[int]],
             head: str = "logits", all_logits: bool = False):
        """Every row's new tokens in one packed call; outputs per `head` (Runner.run's) at each row's last new
        token (every new token with `all_logits`), in the rows' order. No token's KV is written where the
        row's shared blocks already hold it (`PagedRow.present`: a cached prefix computed again for its logits)."""
        self._check_head(head)
        skip = [range(max(0, min(row.present - past, len(ids)))) for row, past, ids in zip(rows, past_lens, new_ids)]
        layout = paged_inputs([row.blocks for row in rows], past_lens, [len(ids) for ids in new_ids],
                              self.spec.block_size, self.max_blocks, skip)
        ends = layout.cumulative_sequence_length.astype(np.int64)
        index = np.arange(ends[-1]) if all_logits else ends[1:] - 1
        feeds = {"input_ids": np.array([[t for ids in new_ids for t in ids]], np.int64),  # [1, tokens]
                 "logits_index": index, "top_k": np.array([self.top_k if head == "topk" else 1], np.int64),
                 **layout.feeds()}
        binding = self.session.io_binding()
        for name, array in feeds.items():
            if name in self.input_names:
                binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, value in self.tables.items():
            binding.bind_ortvalue_input(name, value)
        names = {"logits": ["logits"], "next_token": ["next_token"], "topk": ["topk_values", "topk_indices"]}[head]
        for name in names:  # first: outputs come back in binding order, and only these are read
            binding.bind_output(name, "cpu")
        self.cache.bind(binding)
        self.session.run_with_iobinding(binding)
        outputs = [value.numpy() for value in binding.get_outputs()[:len(names)]]
        return tuple(outputs) if head == "topk" else outputs[0]
