"""The compiled FSDP2 scenarios on one GPU with NCCL (one rank): CUTLASS wgrads, compiled.

``scenarios.compile_scenarios`` — per block (``fullgraph=True``, as
torchtitan), per block around activation checkpointing, and the whole
sharded model — at GPU-friendly sizes, checked as on the CPU: bf16 compute
within twice PyTorch's own bf16 error against the fp64 replay, and the
experts' fp32 gradients under 1 % exactly bf16 (one rank reduce-scatters
nothing, so the gradients FSDP2 hands the optimizer are measured).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from groupgrad_testsupport import Launches, load_sibling

moe_model = load_sibling(__file__, "moe_model")
reference = load_sibling(__file__, "reference")
reduce_scatter = load_sibling(__file__, "reduce_scatter")
scenarios = load_sibling(__file__, "scenarios")

pytestmark = pytest.mark.gpu(1)

WORKER = Path(__file__).with_name("fsdp2_worker.py")
SHAPE = {**moe_model.SHAPE, "hidden": 128, "ffn": 64, "experts": 4, "tokens": 512}
SCENARIOS = [
    {**cfg, "name": f"gpu_{cfg['name']}"} for cfg in scenarios.compile_scenarios(SHAPE, 70)
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, WORKER, {1: SCENARIOS}, device="cuda", timeout_s=600.0)


@functools.cache
def _replays(name: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    return reference.replays(next(c for c in SCENARIOS if c["name"] == name), 1, moe_model)


@pytest.mark.parametrize("name", [c["name"] for c in SCENARIOS])
def test_compiled_nccl_training_matches_the_fp64_replay(runs: Launches, name: str) -> None:
    cfg = next(c for c in SCENARIOS if c["name"] == name)
    fp64, bf16 = _replays(name)
    scenarios.check_training(cfg, runs(1)[name], fp64, bf16)


@pytest.mark.parametrize("name", [c["name"] for c in SCENARIOS])
def test_compiled_expert_grads_are_unrounded_fp32(runs: Launches, name: str) -> None:
    """One rank reduce-scatters nothing; the gradient FSDP2 hands the optimizer is checked instead."""
    (result,) = runs(1)[name]
    for step in result["grads"]:
        experts = [g for n, g in step.items() if scenarios.is_expert(n)]
        assert experts
        assert all(g.dtype == torch.float32 for g in experts)
        share = reduce_scatter.representable_in_bf16(torch.cat([g.flatten() for g in experts]))
        assert share < 0.01, (name, share)
