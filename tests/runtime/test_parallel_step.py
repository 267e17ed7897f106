"""The typed contracts between tensor-parallel ranks: a Step survives its tensor form and the two
broadcasts that carry it; the call-shape cache keeps the most recent shapes and counts the ones it binds."""
from __future__ import annotations

import datetime

import numpy as np
import torch

from runtime.model.call_cache import CallCache
from runtime.parallel.step import HEADER, Step, receive, send


def _step() -> Step:
    return Step(start=2, ids=np.arange(6, dtype=np.int64).reshape(2, 3), seqlens=np.array([4, 7]), total_len=8,
                copies=((0, 2, 5), (1, 3, 4)))


def test_a_step_round_trips_through_its_tensor():
    step = _step()
    tensor = step.to_tensor()
    assert tensor.dtype == torch.int64 and len(tensor) == HEADER + 6 + 2 + 6
    back = Step.from_tensor(tensor)
    assert (back.start, back.total_len, back.copies, back.stop) == (2, 8, ((0, 2, 5), (1, 3, 4)), False)
    assert back.ids.tolist() == [[0, 1, 2], [3, 4, 5]] and back.seqlens.tolist() == [4, 7]
    assert Step.from_tensor(Step(stop=True).to_tensor()).stop


def test_send_and_receive_carry_a_step_in_two_broadcasts():
    sent: list[torch.Tensor] = []
    send(_step(), lambda tensor, timeout=None: sent.append(tensor.clone()))
    assert [len(t) for t in sent] == [HEADER, 14]  # the header sizes the rest
    pending = iter(sent)
    received = receive(lambda tensor, timeout=None: tensor.copy_(next(pending)), datetime.timedelta(seconds=1))
    assert received.ids.tolist() == [[0, 1, 2], [3, 4, 5]] and received.copies == ((0, 2, 5), (1, 3, 4))

    sent.clear()
    send(Step(stop=True), lambda tensor, timeout=None: sent.append(tensor.clone()))
    assert len(sent) == 1  # a stop is its header alone
    pending = iter(sent)
    assert receive(lambda tensor, timeout=None: tensor.copy_(next(pending)), datetime.timedelta(seconds=1)).stop


def test_call_cache_keeps_the_most_recent_shapes():
    cache, made = CallCache(limit=2), []

    def make(key):
        made.append(key)
        return f"call {key}"

    for key in ("a", "b", "a", "c", "a", "b"):
        assert cache.use(key, lambda k=key: make(k)) == f"call {key}"
    assert made == ["a", "b", "c", "b"]  # "b" was the least recently used when "c" came
    assert cache.made == 4 and list(cache) == ["a", "b"]
