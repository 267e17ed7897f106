"""tools.bench.gpu_check's non-GPU parts, on CPU: the same builds, decode and concurrency measurements, table."""
from __future__ import annotations

from click.testing import CliRunner

from tools.bench.gpu_check import main


def test_smoke_run_on_cpu_prints_every_measurement():
    result = CliRunner().invoke(main, ["--device", "cpu", "--tiny", "--repeats", "1", "--skip-peers"])
    assert result.exit_code == 0, result.output
    for row in ("copy bandwidth GB/s", "build float32 s", "ours float32 batch 8 tok/s", "ours int4 batch 1 tok/s",
                "4 concurrent tok/s", "TTFT p50 ms", "int4 / fp batch 1", "of roofline"):
        assert row in result.output, row
