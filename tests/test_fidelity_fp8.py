"""The FP8 fidelity run (``benchmarks/fidelity_fp8.py --smoke``) end to end on the CPU.

Run in-process on the reference kernels: the JSON has every field the report
and the H200 run need, every number is finite, bf16's loss falls over the
steps, FP8 and bf16 train the same model on the same data (their losses
differ by FP8's rounding only), FP8's wgrad errs by e4m3's rounding where
bf16's GEMM is near exact, and the accumulated ``main_grad`` check passes
with the layer's first micro-batch equal to the rebuilt operands' GEMM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fidelity_fp8  # noqa: E402
import fidelity_report  # noqa: E402


def _finite(value: object) -> bool:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, int | float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return False


def test_smoke_run_trains_both_recipes_and_checks_the_wgrads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fidelity_fp8.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    data = json.loads((tmp_path / "fidelity_fp8_cpu_smoke.json").read_text())
    assert (tmp_path / "fidelity_fp8_cpu_smoke.png").stat().st_size > 0
    assert data["complete"] is True
    assert _finite({k: v for k, v in data.items() if k not in ("gpu", "date", "device")})

    steps = data["config"]["steps"]
    runs = {(r["recipe"], r["seed"]): r for r in data["runs"]}
    assert set(runs) == {("bf16", 0), ("fp8", 0)}
    bf16, fp8 = runs["bf16", 0]["losses"], runs["fp8", 0]["losses"]
    assert len(bf16) == len(fp8) == steps
    assert bf16[-1] < bf16[0], bf16  # the model learns: training loss, and held-out loss
    assert runs["bf16", 0]["eval_loss"] < runs["bf16", 0]["eval_loss_init"] - 0.05
    # one init, one data stream: the recipes differ by FP8's rounding, not by another model
    assert bf16[0] != fp8[0]
    assert abs(bf16[0] - fp8[0]) < 1e-2
    assert all(abs(a - b) < 0.05 for a, b in zip(bf16, fp8, strict=True))

    summary = data["summary"]
    assert set(summary["recipes"]) == {"bf16", "fp8"}
    assert summary["recipes"]["bf16"]["final"] == [runs["bf16", 0]["final_loss"]]
    assert summary["bound"] == pytest.approx(0.015 * summary["recipes"]["bf16"]["mean"])
    assert summary["within"] is True

    gemm, layer = data["wgrad_error"]["gemm"], data["wgrad_error"]["layer"]
    for name in ("fc1", "fc2"):
        assert gemm[name]["bf16"] < 1e-6  # fp32 products of bf16 values: near exact
        assert 5e-3 < gemm[name]["fp8"] < 0.1  # e4m3's rounding of both operands
        assert gemm[name]["fp8_vs_dequantized"] < 1e-6
        assert 1e-4 < layer[name]["bf16"] < 2e-2 < layer[name]["fp8"] < 0.2

    main_grad = data["main_grad"]
    assert main_grad["micro_batches"] == 4
    for name in ("fc1", "fc2"):
        check = main_grad[name]
        assert check["first_microbatch_equals_replica_gemm"] is True
        assert check["within_2x_tolerance"] is True
        assert check["rel_error_vs_fp64_sum"] <= 2 * check["per_gemm_tolerance"]
        assert check["bf16_exact_share"] < 0.01

    assert "Gap FP8 − bf16" in stdout
    assert "| fc1 |" in stdout


def test_report_renders_a_partial_json(tmp_path: Path) -> None:
    """A run cut after one recipe still gives a table (no gap) and a plot."""
    result = {
        "gpu": "NVIDIA H200",
        "torch": "2.11",
        "date": "today",
        "complete": False,
        "config": dataclasses.asdict(fidelity_fp8.Config()),
        "loss_start": math.log(4096),
        "loss_floor": 2.0,
        "runs": [
            {"recipe": "bf16", "seed": 0, "losses": [8.0, 5.0, 4.0], "final_loss": 4.5,
             "eval_loss": 4.4, "seconds": 9.0},
        ],
    }  # fmt: skip
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(result))
    assert fidelity_report.main([str(path)]) == 0
    assert path.with_suffix(".png").stat().st_size > 0
    text = fidelity_report.markdown(result)
    assert "partial" in text
    assert "| bf16 | 4.5000 |" in text
    assert "Gap" not in text
