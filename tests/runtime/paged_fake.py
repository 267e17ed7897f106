"""A stand-in for a paged engine's ONNX Runtime session on CPU (PagedAttention has no CPU kernel): it takes
what PagedModelRunner binds and plays the part of PagedAttention and the model at the level of token
identities, so a test checks the runner's contract, not the kernel's arithmetic.

The pool holds, per flat KV slot, the identity of the KV written there: the tuple of token ids it was
computed from (a token's K/V depends on every token up to it). A call reads each sequence's past through
its block table, refuses a layout that reads anything but that sequence's own history, writes each new
token's identity where slot_mapping says (checking -1 only where the slot already holds that very KV), and
scores the next token from the history it read: a deterministic model (`next_logits`), so a request's
tokens equal `reference_run`'s over its own prompt only if every read went to the right KV."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

VOCAB = 512


def next_logits(history: tuple[int, ...]) -> np.ndarray:
    """The model: a peak at a token set by the last one (so continuations repeat and n-gram drafts are often
    right) over noise seeded by the whole history (which now and then wins). [vocab] float32."""
    noise = np.random.default_rng(zlib.crc32(np.asarray(history, np.int64).tobytes())).standard_normal(VOCAB)
    noise[history[-1] * 7 % 23 + 4] += 3.5
    return noise.astype(np.float32)


def reference_run(prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of the model over `prompt` alone (the independent reference)."""
    history = list(prompt)
    for _ in range(new_tokens):
        history.append(int(np.argmax(next_logits(tuple(history)))))
    return history[len(prompt):]


@dataclass
class Arg:
    name: str
    shape: list


@dataclass
class Call:
    """One call's inputs as bound (what the runner would hand ONNX Runtime)."""

    feeds: dict[str, np.ndarray]
    outputs: list[str]


class FakeBinding:
    def __init__(self):
        self.feeds, self.outputs, self.pools, self.values = {}, [], {}, []

    def bind_cpu_input(self, name, array):
        self.feeds[name] = np.array(array)  # a copy: what the call sees at bind time

    def bind_ortvalue_input(self, name, value):
        self.feeds[name] = value

    def bind_input(self, name, device, device_id, element, shape, pointer):
        self.pools[name] = (pointer, tuple(shape))

    def bind_output(self, name, device="cpu", *rest):
        if rest:
            self.pools[name] = (rest[-1], tuple(rest[-2]))
        else:
            self.outputs.append(name)

    def get_outputs(self):
        return self.values


class _Value:
    def __init__(self, array):
        self._array = array

    def numpy(self):
        return self._array


@dataclass
class FakeSession:
    """get_inputs/get_outputs from the engine's graph; run_with_iobinding plays the model (see the module)."""

    model_path: Path
    block_size: int
    pool: dict[int, tuple[int, ...]] = field(default_factory=dict)  # flat slot -> identity of its KV
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self):
        graph = onnx.load(str(self.model_path), load_external_data=False).graph
        dims = lambda v: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
        self._inputs = [Arg(v.name, dims(v)) for v in graph.input]
        self._outputs = [Arg(v.name, dims(v)) for v in graph.output]

    def get_inputs(self):
        return self._inputs

    def get_outputs(self):
        return self._outputs

    def io_binding(self):
        return FakeBinding()

    def run_with_iobinding(self, binding: FakeBinding, options=None):
        f = binding.feeds
        assert {f"past_key_{i}" for i in range(2)} <= set(binding.pools), "the block pools are not bound"
        self.calls.append(Call({k: v for k, v in f.items() if isinstance(v, np.ndarray)}, list(binding.outputs)))
        ids, cum = f["input_ids"][0], f["cumulative_sequence_length"]
        identities = []
        for i, past in enumerate(f["past_seqlens"]):
            history = self._read(f["block_table"][i], int(past))
            for j in range(cum[i], cum[i + 1]):
                history = history + (int(ids[j]),)
                self._write(int(f["slot_mapping"][j]), self._slot(f["block_table"][i], len(history) - 1), history)
                identities.append(history)
        picked = [identities[int(k)] for k in f["logits_index"]]
        logits = np.stack([next_logits(h) for h in picked])
        k = int(f["top_k"][0])
        order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        produce = {"logits": logits, "next_token": logits.argmax(-1).astype(np.int64),
                   "topk_values": np.take_along_axis(logits, order, -1), "topk_indices": order.astype(np.int64)}
        binding.values = [_Value(produce[name]) for name in binding.outputs]

    def _slot(self, table: np.ndarray, position: int) -> int:
        block = int(table[position // self.block_size])
        assert block >= 0, f"position {position} has no block in the table {table.tolist()}"
        return block * self.block_size + position % self.block_size

    def _read(self, table: np.ndarray, past: int) -> tuple[int, ...]:
        """The sequence's history from its past's KV: each position must hold the KV of the same prefix."""
        if past == 0:
            return ()
        history = self.pool.get(self._slot(table, past - 1))
        assert history is not None and len(history) == past, f"position {past - 1}: no KV, or another position's"
        for p in range(past - 1):
            assert self.pool.get(self._slot(table, p)) == history[:p + 1], f"position {p} holds another sequence's KV"
        return history

    def _write(self, mapped: int, expected: int, history: tuple[int, ...]) -> None:
        if mapped == -1:  # not written: the block already holds this very KV (a shared cached block)
            assert self.pool.get(expected) == history, f"a skipped write at position {len(history) - 1} loses its KV"
            return
        assert mapped == expected, f"position {len(history) - 1} written to slot {mapped}, its block says {expected}"
        self.pool[mapped] = history
