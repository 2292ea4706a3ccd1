"""FP8 in Megatron-Core on one GPU (NCCL, one rank): the fused experts' CUTLASS path under Megatron.

``fp8_worker.py``'s scenarios on CUDA, nothing patched: an MoE layer with
``fp8="e4m3"`` and ``fp8_recipe="blockwise"`` under Megatron's DDP,
``DistributedOptimizer`` and no-pipelining schedule (two optimizer steps of
two micro-batches), where the first micro-batch after each ``step()`` must
use the new weights quantized afresh and the second the cached ones; and
``first_last_layers_bf16``'s first and last layers running bf16 while the
middle one runs FP8 (each equal to a ``GroupedMLP`` of that precision on
the same weights, bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from groupgrad_testsupport import Launches, load_sibling

checks = load_sibling(__file__, "checks")

pytestmark = pytest.mark.gpu(1)

WORKER = Path(__file__).with_name("fp8_worker.py")
SCENARIOS = [{"name": "step", "kind": "step"}, {"name": "bf16-layers", "kind": "bf16_layers"}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, WORKER, {1: SCENARIOS}, device="cuda", timeout_s=600)


def test_fp8_layer_requantizes_after_each_distributed_optimizer_step(runs: Launches) -> None:
    (result,) = runs(1)["step"]
    checks.assert_fp8_step_requantizes(result)


def test_fp8_first_and_last_layers_run_bf16_on_the_gpu(runs: Launches) -> None:
    (result,) = runs(1)["bf16-layers"]
    checks.assert_first_and_last_layers_bf16(result)
