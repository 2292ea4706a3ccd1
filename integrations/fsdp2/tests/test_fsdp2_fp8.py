"""FP8 (``fp8_recipe="blockwise"``) groupgrad layers under FSDP2 on 2 gloo ranks.

One launch of ``fsdp2_worker.py`` trains a one-block MoE model (``GroupedMLP``
or two ``GroupedLinear``, per-expert or packed, biases; hidden and expert
width 128, the FP8 blocks' size) sharded per block and at the root, in fp32
or with bf16 compute (``param_dtype=bf16``, ``reduce_dtype=fp32``), with
gradient accumulation without sync and, in one scenario, a DCP round trip
(FP8 state is Python state of the layers, not in the checkpoint). The parent
replays it in one process with the same FP8 model unsharded
(``fp8_replay.py`` says why that oracle is exact): outputs, input gradients,
reduced gradients and weights must agree to 1e-5 of each tensor's maximum.

The ``"stale"`` scenarios pass ``is_first_microbatch=True`` at the first
forward and ``False`` at every later one, across optimizer steps, as a
TransformerEngine user would by mistake or by habit: FSDP2's weights are
re-materialized at every forward and must never be served from a cache, so
they too must equal the replay, which quantizes afresh at every forward.
Whether a cached FP8 weight would pass the cache's own checks after an
optimizer step depends only on where the allocator puts the re-gathered
weights (same parameter object, same version, same shape; the address
decides), so these scenarios pin it to the same address
(``fsdp2_worker.same_address``): a unit that kept its layers' caches
across forwards serves the weights of step 0 at step 1, in every run.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from groupgrad_testsupport import Launches, load_sibling

moe_model = load_sibling(__file__, "moe_model")
fp8_replay = load_sibling(__file__, "fp8_replay")
fp8_scenarios = load_sibling(__file__, "fp8_scenarios")
reduce_scatter = load_sibling(__file__, "reduce_scatter")
scenarios = load_sibling(__file__, "scenarios")

WORKER = Path(__file__).with_name("fsdp2_worker.py")
FP8 = fp8_scenarios.fp8_scenarios()
NAMES = [cfg["name"] for cfg in FP8]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, WORKER, {2: FP8}, timeout_s=600.0)


def _scenario(name: str) -> dict[str, Any]:
    return next(cfg for cfg in FP8 if cfg["name"] == name)


@functools.cache
def _replay(name: str) -> dict[str, Any]:
    return fp8_replay.replay(_scenario(name), 2, moe_model)


@pytest.mark.parametrize("name", NAMES)
def test_fp8_training_matches_the_unsharded_fp8_replay(runs: Launches, name: str) -> None:
    fp8_scenarios.check_matches_replay(_scenario(name), runs(2)[name], _replay(name))


@pytest.mark.parametrize("name", NAMES)
def test_the_experts_really_ran_in_fp8(runs: Launches, name: str) -> None:
    fp8_scenarios.check_ran_in_fp8(_scenario(name), runs(2)[name])


@pytest.mark.parametrize("name", NAMES)
def test_fp8_units_reduce_scatter_fp32_never_rounded_to_bf16(runs: Launches, name: str) -> None:
    cfg, ranks = _scenario(name), runs(2)[name]
    fractions = scenarios.check_reduce_scatters(cfg, ranks, reduce_scatter)
    experts = [f for found in fractions.values() for f in found["experts"]]
    assert experts, fractions
    if cfg["bf16"] and not cfg["empty_expert"]:  # an unused expert's zeros are bf16 values
        assert max(experts) < 0.05, fractions  # bf16-rounded wgrads: 1.0
