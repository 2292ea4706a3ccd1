"""groupgrad layers under FSDP2 on real gloo processes, against a single-process fp64 replay.

Two launches (2 and 4 ranks, ``groupgrad_testsupport``) run every scenario of
``scenarios.py``: two MoE blocks (router ``nn.Linear`` + groupgrad experts:
``GroupedMLP`` or two ``GroupedLinear``, per-expert or packed, biases) and a
dense head, sharded per block and at the root, trained two SGD steps of two
micro-batches (the first without gradient sync; rank 1 sends one expert no
token). The parent replays the same in one process with
``torch.nn.functional`` only, in fp64 (the oracle) and in bf16 (PyTorch's own
bf16 computation), and compares outputs, input gradients, reduced gradients
and weights; a DCP save/load round trip in the middle must change nothing.
What FSDP2 reduce-scatters is recorded through its own
``set_custom_reduce_scatter``: fp32, one call per unit and step, and the
groupgrad parameters' elements under 1 % exactly bf16 (plain FSDP2: all of
them, the check can fail).
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

WORKER = Path(__file__).with_name("fsdp2_worker.py")
SCENARIOS = {2: scenarios.two_rank(moe_model.SHAPE), 4: scenarios.four_rank(moe_model.SHAPE)}
CASES = [(world, cfg["name"]) for world, found in SCENARIOS.items() for cfg in found]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, WORKER, SCENARIOS, timeout_s=600.0)


def _scenario(world: int, name: str) -> dict[str, Any]:
    return next(cfg for cfg in SCENARIOS[world] if cfg["name"] == name)


@functools.cache
def _replays(world: int, name: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    return reference.replays(_scenario(world, name), world, moe_model)


@pytest.mark.parametrize(("world", "name"), CASES, ids=[f"{w}ranks-{n}" for w, n in CASES])
def test_training_matches_the_fp64_replay(runs: Launches, world: int, name: str) -> None:
    cfg = _scenario(world, name)
    fp64, bf16 = _replays(world, name)
    scenarios.check_training(cfg, runs(world)[name], fp64, bf16)


@pytest.mark.parametrize(("world", "name"), CASES, ids=[f"{w}ranks-{n}" for w, n in CASES])
def test_each_unit_reduce_scatters_fp32_once_per_step(
    runs: Launches, world: int, name: str
) -> None:
    cfg = _scenario(world, name)
    scenarios.check_reduce_scatters(cfg, runs(world)[name], reduce_scatter)


RS_CASES = [  # bf16 compute, one micro-batch per step, every expert used on every rank
    (world, cfg["name"])
    for world, found in SCENARIOS.items()
    for cfg in found
    if cfg["bf16"] and cfg["micro_batches"] == 1 and not cfg["empty_expert"]
]


@pytest.mark.parametrize(("world", "name"), RS_CASES, ids=[f"{w}ranks-{n}" for w, n in RS_CASES])
def test_what_fsdp2_reduce_scatters_was_never_rounded_to_bf16(
    runs: Launches, world: int, name: str
) -> None:
    cfg = _scenario(world, name)
    fractions = scenarios.check_reduce_scatters(cfg, runs(world)[name], reduce_scatter)
    expert_units = [unit for unit, found in fractions.items() if found["experts"]]
    assert len(expert_units) == cfg["blocks"], fractions
    for unit, found in fractions.items():
        # the router's and the head's gradients come from bf16 matmuls either way
        assert all(f == 1.0 for f in found["others"]), (unit, found)
        if cfg["integration"]:
            assert all(f < 0.01 for f in found["experts"]), (unit, found)
        else:  # plain FSDP2: every expert wgrad element is a bf16 value upcast
            assert all(f == 1.0 for f in found["experts"]), (unit, found)


def test_the_dcp_scenarios_reload_into_other_weights() -> None:
    """The reloaded model starts from other weights, so a load that did nothing would show."""
    for cfg in SCENARIOS[2]:
        if cfg["dcp"]:
            before = dict(moe_model.build(cfg).named_parameters())
            other = dict(moe_model.build({**cfg, "seed": cfg["seed"] + 1000}).named_parameters())
            assert all(not torch.equal(before[n], other[n]) for n in before)
