"""The Hugging Face MoE benchmark runs end to end at its ``--smoke`` size on the CPU.

Timings on the CPU mean nothing; what is checked is that every variant runs,
the JSON has every field the report and the GPU run need, the ratios are
computed against groupgrad measured in the same run, and groupgrad agrees
with transformers' ``grouped_mm`` experts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from groupgrad_testsupport import run_command

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_hf_moe.py"


def test_smoke_run_writes_every_variant(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    result = run_command(
        [
            sys.executable,
            str(BENCH),
            "--smoke",
            "--rounds",
            "1",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
        ],
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "hf_moe_cpu_smoke.json").read_text())
    variants = {
        f"{i}/{g}" for i in ("groupgrad", "grouped_mm", "eager") for g in ("bf16_grad", "fp32_grad")
    }
    assert set(data["times_ms"]) == variants
    assert set(data["ratio_vs_groupgrad"]) == {v for v in variants if not v.startswith("groupgrad")}
    for name, ratio in data["ratio_vs_groupgrad"].items():
        grad = name.split("/")[1]
        assert ratio == data["times_ms"][name] / data["times_ms"][f"groupgrad/{grad}"]
    assert data["routing"]["tokens_per_expert_max"] > data["routing"]["tokens_per_expert_median"]
    assert max(data["rel_err_groupgrad_vs_grouped_mm"].values()) < 2e-2
    assert "| groupgrad | fp32 (grad_dtype) |" in result.stdout
