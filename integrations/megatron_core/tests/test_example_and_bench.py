"""The GPT-MoE example (2 CPU processes through torchrun) and the benchmark's CPU smoke mode.

Both are run as a user runs them; the example's losses with groupgrad experts
must equal those of Megatron's ``SequentialMLP`` (same initial weights, same
data, fp32), and the benchmark's smoke run must produce its JSON with the
backends agreeing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_benchmark_smoke_mode_runs_and_backends_agree(tmp_path: Path) -> None:
    result = _run([sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path)], timeout=600)
    data = json.loads((tmp_path / "megatron_moe_cpu.json").read_text())
    assert [row["E"] for row in data["rows"]] == [4, 16]
    for row in data["rows"]:
        assert row["routed_tokens"] == row["S"] * row["k"]
        for backend in ("groupgrad_fused", "groupgrad"):
            assert row["speedup_layer"][backend] > 0
            assert row["layer_ms"][backend] > 0
            diffs = row["rel_diff_vs_sequential"][backend]
            assert diffs["output"] <= 1e-5, (backend, diffs)
            assert diffs["input_grad"] <= 1e-5, (backend, diffs)
    if result.returncode == 0:
        assert (tmp_path / "megatron_moe_cpu.png").is_file()
    else:  # 3: matplotlib is not installed; the JSON is all the smoke test needs
        assert "PNG not written" in result.stdout
    assert "| 4, 16, 8, 2, 12 |" in result.stdout
