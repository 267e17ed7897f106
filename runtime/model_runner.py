"""ModelRunner: one ONNX Runtime session over the engine graph, run on a contiguous range of KV
slots through IOBinding so that past and present KV share the cache's memory (updated in place)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime.kv_cache import KVCache
from runtime.kv_spec import KVCacheSpec


def rope_tables(rope: dict, length: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches [length, head_dim/2] the way transformers computes them in float32."""
    inv_freq = np.asarray(rope["inv_freq"], dtype=np.float32)
    freqs = np.outer(np.arange(length, dtype=np.float32), inv_freq).astype(np.float32)
    scale = np.float32(rope["attention_scaling"])
    return (np.cos(freqs) * scale).astype(dtype), (np.sin(freqs) * scale).astype(dtype)


def session_options(threads: int | None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or os.cpu_count() or 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


class ModelRunner:
    """Runs the engine on rows `[start, stop)` of the KV cache.

    A call is either a first prompt for all its rows (seq > 1, positions from 0), a decode step
    (seq == 1, each row at its own length) or, at batch 1, a chunk on top of an existing past."""

    def __init__(self, engine_dir: Path, manifest: dict, spec: KVCacheSpec, threads: int | None = None,
                 providers: list[str] | None = None):
        self.engine_dir, self.spec, self.manifest = engine_dir, spec, manifest
        self.dtype = spec.dtype
        self.session = ort.InferenceSession(str(engine_dir / "model.onnx"), session_options(threads),
                                            providers=providers or ["CPUExecutionProvider"])
        self.cache = KVCache(spec)
        self.cos, self.sin = rope_tables(manifest["rope"], spec.max_seq_len, spec.dtype)
        self.vocab_size = manifest["model"]["hyperparameters"]["vocab_size"]
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}

    def run(self, start: int, input_ids: np.ndarray, seqlens_k: np.ndarray, total_len: int,
            logits_index: np.ndarray) -> np.ndarray:
        """input_ids [rows, seq]; seqlens_k [rows] = each row's total length - 1 (GQA convention);
        total_len = the batch maximum of total lengths; logits_index [n] flat indices into
        rows*seq. Returns logits [n, vocab] float32. KV rows [start, start+rows) are updated in place."""
        rows = input_ids.shape[0]
        binding = self._binding(start, start + rows)
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("logits_index", np.ascontiguousarray(logits_index, dtype=np.int64))
        binding.bind_cpu_input("seqlens_k", np.ascontiguousarray(seqlens_k, dtype=np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(total_len, dtype=np.int32))
        binding.bind_output("logits", "cpu")  # fresh each call: its shape changes with the call
        self.session.run_with_iobinding(binding)
        return np.array(binding.get_outputs()[0].numpy())  # a copy of the logits only; the KV stays in place

    def _binding(self, start: int, stop: int) -> ort.IOBinding:
        """One IOBinding per row range, with the KV views (past and present: the same memory) bound
        once; rope tables too. Per call only the small inputs are rebound."""
        key = (start, stop)
        if key not in self._bindings:
            binding = self.session.io_binding()
            binding.bind_cpu_input("cos_cache", self.cos)
            binding.bind_cpu_input("sin_cache", self.sin)
            binding.bind_output("logits", "cpu")  # first, so get_outputs()[0] is the logits
            for layer, (k, v) in enumerate(self.cache.views(start, stop)):
                binding.bind_ortvalue_input(f"past_key_{layer}", k)
                binding.bind_ortvalue_input(f"past_value_{layer}", v)
                binding.bind_ortvalue_output(f"present_key_{layer}", k)
                binding.bind_ortvalue_output(f"present_value_{layer}", v)
            self._bindings[key] = binding
        return self._bindings[key]

    def prefill(self, start: int, prompts: list[list[int]]) -> np.ndarray:
        """First prompt of rows start.. (positions from 0); returns each row's last logits [rows, vocab]."""
        lens = np.array([len(p) for p in prompts])
        seq = int(lens.max())
        ids = np.zeros((len(prompts), seq), dtype=np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
        last = np.arange(len(prompts)) * seq + lens - 1
        return self.run(start, ids, lens - 1, seq, last)

    def extend(self, slot: int, past_len: int, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Append `tokens` to one row that already holds `past_len` tokens (chunked prefill, verify).
        Returns logits for every new token [n, vocab] or only the last [1, vocab]."""
        n = len(tokens)
        total = past_len + n
        index = np.arange(n) if all_logits else np.array([n - 1])
        ids = np.asarray(tokens, dtype=np.int64)[None, :]
        return self.run(slot, ids, np.array([total - 1]), total, index)

    def decode(self, start: int, tokens: np.ndarray, past_lens: np.ndarray) -> np.ndarray:
        """One new token per row for rows start..; past_lens [rows]; returns logits [rows, vocab]."""
        rows = len(tokens)
        return self.run(start, np.asarray(tokens).reshape(rows, 1), past_lens,
                        int(past_lens.max()) + 1, np.arange(rows))
