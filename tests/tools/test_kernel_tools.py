"""tools/bench/kernel_table.py writes the table the builder reads (builder/quant/kernels.py) under this CPU's
instruction set, keeping other sets' entries; tools/bench/op_profile.py sums a decode step's kernel time by op."""
from __future__ import annotations

import json

from click.testing import CliRunner

from builder.quant.kernels import KernelTable, cpu_flags, cpu_isa
from tests.runtime.conftest import trained_engine  # noqa: F401 - the fixture, for the profile
from tools.bench import kernel_table, matmul_nbits


def test_the_table_is_written_for_this_isa_and_read_back(monkeypatch, tmp_path):
    monkeypatch.setitem(matmul_nbits.SHAPES, "smollm2", ([(16, 64)], 2))
    out = tmp_path / "table.json"
    out.write_text(json.dumps({"elsewhere": {"measured": "kept", "us_per_mweight": {"4:32:4": 1.0}}}))
    result = CliRunner().invoke(kernel_table.main, ["--bits", "4,8", "--blocks", "32", "--runs", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    isa = cpu_isa(cpu_flags())
    assert set(data) == {"elsewhere", isa} and set(data[isa]["us_per_mweight"]) == {"4:32:1", "4:32:4", "8:32:1", "8:32:4"}
    table = KernelTable.load(isa, (), out)
    assert table.measured == data[isa]["measured"] and table.time_us(4, 32, 4, 1_000_000) > 0


def test_the_decode_profile_sums_kernel_time_by_op(trained_engine):
    from tools.bench.op_profile import profile

    per_step, steps, tok_s = profile(trained_engine, tokens=4, threads=1)
    assert steps == 3 and tok_s > 0  # the first of 4 tokens comes from the prefill, which is not counted
    assert per_step and all(us >= 0 for us in per_step.values())
    assert "GroupQueryAttention" in per_step
