"""A paged engine (target.attention paged: ONNX Runtime's PagedAttention, CUDA only) run by the same executor
and scheduler as a GQA engine. Its KV cache is one block pool per layer's key and value, and the block ids
are the scheduler's (runtime/batching/block_pool.py, attached to the cache when the scheduler is made): a
call reads each sequence's block table from there and writes each new token's K/V to the slot its block
names, except where a shared cached block already holds it (runtime/model/paged_inputs.py).

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
from runtime.model.paged_inputs import PagedInputs, paged_inputs
from runtime.model.runner import Runner


class PagedKVCache:
    """Per layer a key and a value pool [num_blocks, block_size, kv_heads, head_dim] on the device, updated
    in place; `table`: the scheduler's BlockPool, whose block ids index these pools (`attach`)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str):
        self.spec, self.device, self.num_blocks = spec, device, num_blocks
        self.shape = (num_blocks, spec.block_size, spec.kv_heads, spec.head_dim)
        self.pools = {f"{kind}_{layer}": device_buffer(self.shape, spec.storage_dtype, device)
                      for layer in range(spec.num_layers) for kind in ("key", "value")}
        self.table = None

    def attach(self, table) -> None:
        """The block accounting whose ids are this pool's (one scheduler's at a time)."""
        if table.size != self.spec.block_size or table.num_blocks > self.num_blocks:
            raise ValueError(f"a block table of {table.num_blocks} blocks of {table.size} tokens does not fit this "
                             f"paged cache: {self.num_blocks} blocks of {self.spec.block_size} tokens")
        self.table = table

    def release_row(self, slot: int) -> None:
        """Nothing to hand back: a row's memory is its blocks, which the block pool frees."""

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
    return open_session(path, session_options(config.threads, spinning), providers(manifest, "cuda"))


class PagedModelRunner(Runner):
    """Runs packed steps of a paged engine: `decode_rows` (one new token for each of some rows) and `extend`
    (a prompt chunk or a verify on one row). `num_blocks`: the pool, the KV budget's blocks."""

    packed = True

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

    def run(self, *args, **kwargs):
        raise NotImplementedError("a paged engine runs packed steps (decode_rows, extend), not rows of slots")

    def decode_rows(self, slots: Sequence[int], tokens: Sequence[int], past_lens: Sequence[int],
                    head: str = "logits", blocks: Sequence[Sequence[int]] | None = None):
        """One new token for each of `slots` (any rows, in any order), in one call; outputs per `head` for
        each row, in that order (Runner.run's). `blocks`: the rows' block ids as `block_ids` read them earlier
        (a decode step run ahead, while the scheduler's tables change), instead of the tables now."""
        return self.step(slots, past_lens, [[t] for t in tokens], head, blocks=blocks)

    def block_ids(self, slots: Sequence[int]) -> list[list[int]]:
        """A copy of each row's block ids now (covering the tokens the scheduler reserved for it)."""
        return [list(self.cache.table.rows[s]) for s in slots]

    def extend(self, slot: int, past_len: int, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Runner.extend on the row's blocks: logits of every new token [n, vocab], or of the last [1, vocab]."""
        return self.step([slot], [past_len], [tokens], all_logits=all_logits)

    def inputs(self, slots: Sequence[int], past_lens: Sequence[int], new_ids: Sequence[Sequence[int]]) -> PagedInputs:
        """The step's layout from the attached block pool: each row's block ids, and no write where a row's
        shared blocks already hold a new token's KV (a cached prefix computed again only for its logits)."""
        table = self.cache.table
        if table is None:
            raise RuntimeError("a paged runner lays out a call from the scheduler's blocks: run it under an Executor, "
                               "whose scheduler attaches them to its cache")
        skip = [range(max(0, min(table.present[s] - p, len(ids)))) for s, p, ids in zip(slots, past_lens, new_ids)]
        return paged_inputs([table.rows[s] for s in slots], past_lens, [len(ids) for ids in new_ids],
                            self.spec.block_size, self.max_blocks, skip)

    def step(self, slots: Sequence[int], past_lens: Sequence[int], new_ids: Sequence[Sequence[int]],
             head: str = "logits", all_logits: bool = False, blocks: Sequence[Sequence[int]] | None = None):
        """Every row's new tokens in one packed call; outputs at each row's last new token (every new token
        with `all_logits`). `blocks`: decode_rows'."""
        self._check_head(head)
        layout = self.inputs(slots, past_lens, new_ids) if blocks is None else paged_inputs(
            blocks, past_lens, [len(ids) for ids in new_ids], self.spec.block_size, self.max_blocks)
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
