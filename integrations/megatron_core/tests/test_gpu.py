"""On 2 GPUs with NCCL: the layer comparison with expert parallelism 2, Megatron's delayed-wgrad schedule.

* The MoE layer (Megatron's alltoall dispatcher, EP = 2, fused and unfused
  experts, ``gradient_accumulation_fusion``, with and without
  ``delay_wgrad_compute``): fp32 equal to ``SequentialMLP``, bf16 within twice
  its error against its fp64 run (``mcore_worker.py``, as on the CPU).
* The GPT-MoE example under Megatron's own delayed-wgrad schedule
  (``overlap_moe_expert_parallel_comm`` + ``delay_wgrad_compute``: its combined
  1F1B schedule calls ``backward_dw()``; bf16, alltoall, EP = 2; megatron-core
  0.19, whose local attention linears have ``backward_dw``): losses track
  ``SequentialMLP``'s under the same schedule; and in fp32 without it, equal.

(The README's example runs through ``tests/test_readme_blocks.py`` on GPUs.)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from groupgrad_testsupport import Launches, load_sibling, run_command, torchrun

pytestmark = pytest.mark.gpu(2)

WORKER = Path(__file__).with_name("mcore_worker.py")
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "train_megatron_core_moe.py"
scenarios = load_sibling(__file__, "scenarios")
checks = load_sibling(__file__, "checks")

GPU_FP32_REL = 1e-4
"""fp32 on GPUs: cuBLAS may order a GEMM's sums differently for different shapes."""
BF16_LOSS_REL = 2e-2
"""bf16 training under the delayed-wgrad schedule: losses of two backends after a few Adam steps."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(
        tmp_path_factory, WORKER, {2: scenarios.GPU_LAYERS}, device="cuda", timeout_s=900
    )


@pytest.mark.parametrize("name", [s["name"] for s in scenarios.GPU_LAYERS])
def test_moe_layer_on_two_gpus_against_sequential_mlp(runs: Launches, name: str) -> None:
    for rank, result in enumerate(runs(2)[name]):
        where = f"{name} rank {rank}"
        if "fp64" in result:
            checks.assert_bf16_within_twice_sequential(result, where)
        else:
            checks.assert_matches_sequential(result, where, rel=GPU_FP32_REL)
        assert set(result["groupgrad"]["grad_added"].values()) == {True}, where


def _torchrun(script: Path, *args: str, timeout: int = 900) -> str:
    command = [*torchrun(2), str(script), *args]
    result = run_command(command, timeout=timeout, env=dict(os.environ))
    assert result.returncode == 0, (
        f"{' '.join(command)} exited with {result.returncode}:\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-6000:]}"
    )
    return result.stdout


def _losses(path: Path) -> dict[str, list[float]]:
    losses: dict[str, list[float]] = json.loads(path.read_text())["losses"]
    for backend, values in losses.items():
        assert all(math.isfinite(v) for v in values), f"{backend}: {values}"
    return losses


def _assert_tracks(losses: dict[str, Any], rel: float) -> None:
    reference = losses["sequential"]
    assert reference[-1] < reference[0], f"SequentialMLP did not train: {reference}"
    for backend in ("groupgrad-fused", "groupgrad"):
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses[backend], reference, strict=True))
        assert worst <= rel, f"{backend} {losses[backend]} vs SequentialMLP {reference}"


def test_example_under_megatrons_delayed_wgrad_schedule(tmp_path: Path) -> None:
    from groupgrad.integrations.megatron_core import MEGATRON_CORE_VERSION

    if MEGATRON_CORE_VERSION < (0, 19):
        pytest.skip(
            "megatron-core 0.16's local attention linears have no backward_dw(), which its "
            "delayed-wgrad schedule calls (it needs Transformer Engine there); run with 0.19"
        )
    out = tmp_path / "losses.json"
    _torchrun(
        EXAMPLE,
        *("--dtype", "bf16", "--dispatcher", "alltoall", "--overlap-ep-comm", "--delay-wgrad"),
        *("--steps", "6", "--micro-batches", "2", "--out", str(out)),
    )
    _assert_tracks(_losses(out), BF16_LOSS_REL)


def test_example_fp32_on_two_gpus_equals_sequential(tmp_path: Path) -> None:
    out = tmp_path / "losses.json"
    _torchrun(EXAMPLE, "--steps", "4", "--out", str(out))
    _assert_tracks(_losses(out), GPU_FP32_REL)
