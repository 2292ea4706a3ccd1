"""The GPT-MoE example (2 CPU processes through torchrun) and the benchmark's CPU smoke mode.

Both are run as a user runs them; the example's losses with groupgrad experts
must equal those of Megatron's ``SequentialMLP`` (same initial weights, same
data, fp32), and the benchmark's smoke run must produce its JSON with the
backends agreeing, FP8 within its quantization error where the shape allows
it (the reference kernels on the CPU).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from groupgrad_testsupport import run_command, torchrun

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "train_megatron_core_moe.py"
BENCH = ROOT / "benchmarks" / "bench_megatron_moe.py"
LOSS_REL = 1e-5


def _cpu_env() -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _run(command: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    result = run_command(command, env=_cpu_env(), timeout=timeout)
    assert result.returncode in (0, 3), (
        f"{' '.join(command)} exited with {result.returncode}:\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-5000:]}"
    )
    return result


def test_gpt_moe_example_losses_equal_sequential_mlp(tmp_path: Path) -> None:
    out = tmp_path / "losses.json"
    _run([*torchrun(2), str(EXAMPLE), "--steps", "4", "--ep", "2", "--out", str(out)], timeout=600)
    losses = json.loads(out.read_text())["losses"]
    reference = losses["sequential"]
    assert len(reference) == 4
    assert reference[-1] < reference[0] - 0.1, f"SequentialMLP did not train: {reference}"
    for backend in ("groupgrad-fused", "groupgrad"):
        ours = losses[backend]
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, reference, strict=True))
        assert worst <= LOSS_REL, f"{backend} losses {ours} vs SequentialMLP {reference}"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """The benchmark's smoke run: its stdout and JSON."""
    out = tmp_path_factory.mktemp("bench")
    result = _run([sys.executable, str(BENCH), "--smoke", "--out", str(out)], timeout=600)
    if result.returncode == 3:  # matplotlib is not installed; the JSON is all the tests need
        assert "PNG not written" in result.stdout
    else:
        assert (out / "megatron_moe_cpu.png").is_file()
    return result.stdout, json.loads((out / "megatron_moe_cpu.json").read_text())


def test_benchmark_smoke_mode_runs_and_backends_agree(smoke: tuple[str, dict]) -> None:
    stdout, data = smoke
    assert [row["E"] for row in data["rows"]] == [4, 16]
    for row in data["rows"]:
        assert row["routed_tokens"] == row["S"] * row["k"]
        for backend in ("groupgrad_fused", "groupgrad"):
            assert row["speedup_layer"][backend] > 0
            assert row["layer_ms"][backend] > 0
            diffs = row["rel_diff_vs_sequential"][backend]
            assert diffs["output"] <= 1e-5, (backend, diffs)
            assert diffs["input_grad"] <= 1e-5, (backend, diffs)
        for backend, share in row["outside_experts_share"].items():
            assert math.isfinite(share), (backend, share)
            assert share < 1, (backend, share)
    assert "| 4, 128, 128, 2, 12 |" in stdout


def test_benchmark_smoke_mode_runs_fp8_where_the_shape_allows(
    smoke: tuple[str, dict],
) -> None:
    # Catches: the FP8 backend silently running bf16 (no quantization error), its cached
    # variant serving other weights than its own layer's, FP8 rows missing or not finite.
    stdout, data = smoke
    fp8_row, skipped = data["rows"]
    fresh, cached = "groupgrad_fused_fp8", "groupgrad_fused_fp8_cached"
    for backend in (fresh, cached):
        for key in ("layer_ms", "experts_ms", "speedup_layer", "outside_experts_share"):
            assert math.isfinite(fp8_row[key][backend]), (key, backend, fp8_row[key])
        for part in ("layer", "experts"):
            ratio = fp8_row["fp8_vs_bf16_fused"][backend][part]
            assert 0 < ratio < math.inf, (backend, part, ratio)
    diffs = fp8_row["rel_diff_vs_sequential"]
    for part in ("output", "input_grad"):
        assert 1e-3 < diffs[fresh][part] < 0.25, diffs[fresh]  # FP8's error, not fp32's
    assert diffs[cached] == diffs[fresh]  # the same layer, its weights quantized once
    assert "fp8_vs_bf16_fused" not in skipped
    assert fresh not in skipped["layer_ms"]
    assert "multiples of 128" in skipped["fp8_skipped"]
    assert "| 4, 128, 128, 2, 12 | " in stdout.split("FP8 (fp8='e4m3'")[1]
