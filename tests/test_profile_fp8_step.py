"""The FP8 step profile runs end to end on the CPU (``--quick``) and profiles what each variant says.

Each variant's step calls the ops its name promises, as counted by the
profiler: bf16 the bf16 GEMMs only; FP8 the FP8 GEMMs and one quantization of
``x`` and of ``dy``; uncached FP8 also the weights (at forward, both layers:
2; each layer keeps them for its dgrad), cached FP8 none — so a cached
variant that missed its cache, or a bf16 variant that ran FP8, fails here.
The wrapped host timings (``host_functions``) count the same calls from the
Python side: the weight cache's lookups and the held weights' hand-over.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from groupgrad_testsupport import run_command

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "profile_fp8_step.py"
GEMMS = ("grouped_fprop", "grouped_dgrad", "grouped_wgrad")


def test_smoke_run_profiles_each_variant(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(tmp_path)]
    result = run_command(command, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "profile_fp8_step_cpu_smoke.json").read_text())["rows"]
    assert list(rows) == [
        f"{kind} {layout}"
        for layout in ("packed", "per-expert")
        for kind in ("bf16", "fp8", "fp8_cached")
    ]
    for name, row in rows.items():
        ops = row["groupgrad_ops"]
        fp8 = name.startswith("fp8")
        for gemm in GEMMS:
            assert ops.get(f"groupgrad::{'fp8_' if fp8 else ''}{gemm}") == 2, (name, ops)
        quantized = {op: n for op, n in ops.items() if "quantize" in op}
        if not fp8:
            assert not quantized, (name, ops)
        else:
            weights = 0 if name.startswith("fp8_cached") else 2
            assert quantized.get("groupgrad::quantize_fp8_weights", 0) == weights, (name, ops)
            assert quantized["groupgrad::quantize_fp8_segments"] == 2, (name, ops)
        assert row["host_ms"] > 0, name
        calls = {f: v["calls"] for f, v in row["host_functions"].items()}
        assert calls["GroupedMLP.forward"] == calls["backward"] == 1, (name, calls)
        if not fp8:
            assert "quantize_fp8" not in calls, (name, calls)
        elif name.startswith("fp8_cached"):  # x and dy only; fprop and dgrad served by the cache
            assert (calls["quantize_fp8"], calls["Fp8WeightCache.get"]) == (2, 4), (name, calls)
            assert "Fp8WeightCache.put" not in calls, (name, calls)
        else:  # each layer's forward quantizes and holds its weights, its dgrad takes them
            assert (calls["quantize_fp8"], calls["Fp8WeightCache.put"]) == (4, 2), (name, calls)
            assert calls["Fp8WeightCache.get"] == 2, (name, calls)
        assert row["step_ms"] is None, name  # no CUDA time on the CPU
        assert row["top"], name
    assert "| fp8_cached per-expert | — |" in result.stdout
