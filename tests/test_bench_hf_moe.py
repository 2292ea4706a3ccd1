"""The Hugging Face MoE benchmark runs end to end at its ``--smoke`` size on the CPU.

Timings on the CPU mean nothing; what is checked is that every variant runs,
the JSON has every field the report and the GPU run need, the ratios are
computed against groupgrad measured in the same run, and groupgrad agrees
with transformers' ``grouped_mm`` experts — ``groupgrad_fp8`` (the smoke
size is a multiple of 128) within FP8's error, and not closer (it quantizes).
"""

from __future__ import annotations

import json
import math
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
    rows = data["rows"]
    # the default sweep: 3 skews × checkpointing off / on, eager only at σ = 1 without it
    assert [(r["sigma"], r["checkpointing"]) for r in rows] == [
        (s, c) for s in (0.5, 1.0, 2.0) for c in (False, True)
    ]
    cvs = [r["routing"]["tokens_per_expert_cv"] for r in rows[::2]]
    assert cvs == sorted(cvs), cvs  # heavier skew, larger spread
    assert cvs[0] < cvs[-1], cvs
    for row in rows:
        impls = ("groupgrad", "groupgrad_fp8", "groupgrad_unrouted", "grouped_mm") + (
            ("eager",) if (row["sigma"], row["checkpointing"]) == (1.0, False) else ()
        )
        variants = {f"{i}/{g}" for i in impls for g in ("bf16_grad", "fp32_grad")}
        assert set(row["times_ms"]) == set(row["peak_bytes"]) == variants
        assert set(row["ratio_vs_groupgrad"]) == {
            v for v in variants if v.split("/")[0] != "groupgrad"
        }
        for name, ratio in row["ratio_vs_groupgrad"].items():
            grad = name.split("/")[1]
            assert ratio == row["times_ms"][name] / row["times_ms"][f"groupgrad/{grad}"]
        assert row["routing"]["tokens_per_expert_max"] > row["routing"]["tokens_per_expert_median"]
        assert max(row["rel_err_groupgrad_vs_grouped_mm"].values()) < 2e-2
        # Catches: "groupgrad_fp8" running bf16 GEMMs (error at bf16's level) or broken FP8.
        fp8_errors = row["rel_err_groupgrad_fp8_vs_grouped_mm"]
        assert set(fp8_errors) == {"out", "d_gate_up_proj", "d_down_proj"}
        for key, error in fp8_errors.items():
            assert 1e-2 < error < 0.15, (key, fp8_errors)
        for grad in ("bf16_grad", "fp32_grad"):
            assert 0 < row["times_ms"][f"groupgrad_fp8/{grad}"] < math.inf
        assert "fp8_skipped" not in row
    assert "| off | fp32 (grad_dtype) | groupgrad |" in result.stdout
    assert "| on | fp32 (grad_dtype) | groupgrad_fp8 |" in result.stdout
    assert "- over bf16 groupgrad (groupgrad's time / FP8's): " in result.stdout
    assert "- over bf16 groupgrad_unrouted (groupgrad_unrouted's time / FP8's): " in result.stdout
    assert "| on | bf16 | grouped_mm |" in result.stdout
