"""FP8 (``fp8_recipe="blockwise"``) groupgrad layers under FSDP2 on one GPU with NCCL (one rank).

The CPU suite's FP8 scenarios (``fp8_scenarios.py``: ``GroupedMLP`` and two
``GroupedLinear``, per-expert and packed, fp32 and bf16 compute, a DCP round
trip, the ``"stale"`` caching habit with the re-gathered weights pinned to
the cached address) on CUDA, where the experts' GEMMs are the CUTLASS FP8
kernels and the quantizers Triton's. Checked against the single-process
replay run on the same GPU (the same kernels on the same operands, weights
quantized afresh at every forward, each step from the rank's weights of the
step before: ``fp8_replay.replay``'s ``restart_from``) to 1e-5 of each
tensor's maximum; the expert gradients differ from an unquantized fp64
replay by FP8's error; and the gradients FSDP2 hands the optimizer are fp32
with under 5 % of the experts' elements exactly bf16 (one rank
reduce-scatters nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from groupgrad_testsupport import Launches, load_sibling

moe_model = load_sibling(__file__, "moe_model")
fp8_replay = load_sibling(__file__, "fp8_replay")
fp8_scenarios = load_sibling(__file__, "fp8_scenarios")
reduce_scatter = load_sibling(__file__, "reduce_scatter")
scenarios = load_sibling(__file__, "scenarios")

pytestmark = pytest.mark.gpu(1)

WORKER = Path(__file__).with_name("fsdp2_worker.py")
FP8 = fp8_scenarios.fp8_scenarios(prefix="gpu_", seed=80)
NAMES = [cfg["name"] for cfg in FP8]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, WORKER, {1: FP8}, device="cuda", timeout_s=600.0)


def _scenario(name: str) -> dict[str, Any]:
    return next(cfg for cfg in FP8 if cfg["name"] == name)


@pytest.mark.parametrize("name", NAMES)
def test_fp8_nccl_training_matches_the_replay_on_the_same_gpu(runs: Launches, name: str) -> None:
    ranks = runs(1)[name]
    weights = ranks[0]["weights"]
    expected = fp8_replay.replay(_scenario(name), 1, moe_model, "cuda", restart_from=weights)
    fp8_scenarios.check_matches_replay(_scenario(name), ranks, expected)


@pytest.mark.parametrize("name", NAMES)
def test_the_experts_really_ran_in_fp8_on_the_gpu(runs: Launches, name: str) -> None:
    fp8_scenarios.check_ran_in_fp8(_scenario(name), runs(1)[name])


@pytest.mark.parametrize("name", NAMES)
def test_fp8_expert_grads_reach_the_optimizer_in_fp32(runs: Launches, name: str) -> None:
    (result,) = runs(1)[name]
    for step in result["grads"]:
        experts = [g for n, g in step.items() if scenarios.is_expert(n) and ".weight" in n]
        assert experts, name
        assert all(g.dtype == torch.float32 for g in experts), name
        share = reduce_scatter.representable_in_bf16(torch.cat([g.flatten() for g in experts]))
        assert share < 0.05, (name, share)  # bf16-rounded wgrads: 1.0
