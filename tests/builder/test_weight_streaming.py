"""Large tensors the engine writer takes as stored (a float embedding or lm_head) are read, converted and
written in blocks of rows (WeightSource.row_blocks, WeightWriter.write_blocks), with the same bytes as a
whole-tensor write."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from builder.lower_onnx import WeightWriter
from onnx import TensorProto
from builder.weights import ArrayWeight, Checkpoint


ONNX_TYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


@pytest.fixture
def checkpoint(tmp_path):
    table = torch.randn(1000, 64, generator=torch.Generator().manual_seed(0))
    save_file({"embed": table.to(torch.bfloat16), "norm": table[0].clone(), "ids": torch.arange(7)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({}))
    return Checkpoint(tmp_path)


def test_checkpoint_rows_come_in_blocks_of_the_asked_size(checkpoint):
    blocks = list(checkpoint.source("embed").row_blocks(100 * 64 * 4))
    assert [b.shape for b in blocks] == [(100, 64)] * 10 and all(b.dtype == np.float32 for b in blocks)
    np.testing.assert_array_equal(np.concatenate(blocks), checkpoint.read("embed"))
    norm = list(checkpoint.source("norm").row_blocks(100))  # 1-D: rows are elements
    assert [len(b) for b in norm] == [25, 25, 14]
    np.testing.assert_array_equal(np.concatenate(norm), checkpoint.read("norm"))
    np.testing.assert_array_equal(np.concatenate(list(checkpoint.source("ids").row_blocks(8))), np.arange(7))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_block_writes_equal_a_whole_write(checkpoint, tmp_path, dtype):
    source = checkpoint.source("embed")
    whole, blocked = WeightWriter(tmp_path / "whole.data", dtype), WeightWriter(tmp_path / "blocked.data", dtype)
    tensors = []
    for writer, blocks in ((whole, iter([source.materialize()])), (blocked, source.row_blocks(37 * 64 * 4))):
        writer.write("first", np.arange(3, dtype=np.int64))  # the next tensor starts aligned after it
        tensors.append(writer.write_blocks("embed", source.shape, blocks))
        writer.close()
    assert (tmp_path / "whole.data").read_bytes() == (tmp_path / "blocked.data").read_bytes()
    a, b = tensors
    assert (list(a.dims), a.data_type) == (list(b.dims), b.data_type) == ([1000, 64], ONNX_TYPE[dtype])
    where = [[(e.key, e.value) for e in t.external_data if e.key != "location"] for t in tensors]
    assert where[0] == where[1] == [("offset", "4096"), ("length", str(1000 * 64 * (4 if dtype == "float32" else 2)))]


def test_a_builder_array_is_written_whole(tmp_path):
    writer = WeightWriter(tmp_path / "w.data", "float32")
    weight = ArrayWeight(np.ones((4, 2), np.float32))
    tensor = writer.write_blocks("w", weight.shape, weight.row_blocks(1))
    writer.close()
    assert list(tensor.dims) == [4, 2] and (tmp_path / "w.data").stat().st_size == 32
