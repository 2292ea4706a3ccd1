"""The FP8 GroupedMLP benchmark runs end to end on the CPU (``--quick``): every variant, sane errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from groupgrad_testsupport import run_command

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_fp8_mlp.py"


def test_smoke_run_writes_every_variant(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(BENCH), "--quick", "--device", "cpu", "--out", str(tmp_path)]
    result = run_command(command, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "fp8_mlp_cpu_smoke.json").read_text())
    assert [row["split_kind"] for row in data["rows"]] == ["uniform", "heavy"]
    for row in data["rows"]:
        assert set(row["times_ms"]) == {"bf16", "fp8", "fp8_cached"}
        for variant, ratio in row["speedup_vs_bf16"].items():
            assert ratio == row["times_ms"]["bf16"] / row["times_ms"][variant]
        # one model: FP8 differs from bf16 by FP8's rounding, not by other weights
        assert 1e-3 < max(row["rel_err_vs_bf16"].values()) < 0.15, row["rel_err_vs_bf16"]
    assert "| E=4 H=256 F=256 T=512 | heavy |" in result.stdout
