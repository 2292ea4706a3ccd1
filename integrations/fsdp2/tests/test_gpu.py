"""The FSDP2 scenarios on 2 GPUs with NCCL: CUTLASS wgrads in fp32 straight into the reduce-scatter.

Sizes are GPU-friendly (``H = 128``, ``F = 64``, ``T = 256`` per rank) so the
grouped GEMMs take the CUTLASS path. Checked as on the CPU: on the first
step, bf16 compute within twice PyTorch's own bf16 error against the fp64
replay (both computed on the CPU); one fp32 reduce-scatter per unit and
step, with the groupgrad parameters' elements under 1 % exactly bf16 (plain
FSDP2: 100 %).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from groupgrad_testsupport import Launches, load_sibling

moe_model = load_sibling(__file__, "moe_model")
reference = load_sibling(__file__, "reference")
reduce_scatter = load_sibling(__file__, "reduce_scatter")
scenarios = load_sibling(__file__, "scenarios")

pytestmark = pytest.mark.gpu(2)

WORKER = Path(__file__).with_name("fsdp2_worker.py")
SHAPE = {**moe_model.SHAPE, "hidden": 128, "ffn": 64, "experts": 4, "tokens": 256}
SCENARIOS = [
    scenarios.scenario("mlp_packed_bf16", SHAPE, 60, packed=True),
    scenarios.scenario("linear_per_expert_bf16", SHAPE, 61, module="linear", reshard=False),
    *(
        {**cfg, "name": f"gpu_{cfg['name']}"}
        for cfg in scenarios.reduce_scatter_scenarios({**SHAPE, "tokens": 512}, 62)
    ),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, WORKER, {2: SCENARIOS}, device="cuda", timeout_s=600.0)


@functools.cache
def _replays(name: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    return reference.replays(next(c for c in SCENARIOS if c["name"] == name), 2, moe_model)


@pytest.mark.parametrize("name", [c["name"] for c in SCENARIOS])
def test_nccl_training_matches_the_fp64_replay(runs: Launches, name: str) -> None:
    cfg = next(c for c in SCENARIOS if c["name"] == name)
    fp64, bf16 = _replays(name)
    scenarios.check_training(cfg, runs(2)[name], fp64, bf16)


@pytest.mark.parametrize("name", [c["name"] for c in SCENARIOS if c["name"].startswith("gpu_")])
def test_nccl_reduce_scatter_input_is_unrounded_fp32(runs: Launches, name: str) -> None:
    cfg = next(c for c in SCENARIOS if c["name"] == name)
    fractions = scenarios.check_reduce_scatters(cfg, runs(2)[name], reduce_scatter)
    for unit, found in fractions.items():
        if cfg["integration"]:
            assert all(f < 0.01 for f in found["experts"]), (unit, found)
        else:
            assert all(f == 1.0 for f in found["experts"]), (unit, found)
