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
import torch

from groupgrad_testsupport import Launches, load_sibling

moe_model = load_sibling(__file__, "moe_model")
reference = load_sibling(__file__, "reference")
fp8_replay = load_sibling(__file__, "fp8_replay")
reduce_scatter = load_sibling(__file__, "reduce_scatter")
scenarios = load_sibling(__file__, "scenarios")

WORKER = Path(__file__).with_name("fsdp2_worker.py")
SHAPE = {**moe_model.SHAPE, "hidden": 128, "ffn": 128, "tokens": 64, "blocks": 1, "fp8": True}
FP8 = [
    scenarios.scenario("fp8_mlp_per_expert_fp32_stale", SHAPE, 70, bf16=False, fp8_cache="stale"),
    scenarios.scenario(
        "fp8_mlp_packed_bf16_stale",
        SHAPE,
        71,
        packed=True,
        reshard=False,
        fp8_cache="stale",
        empty_expert=False,
    ),
    scenarios.scenario("fp8_linear_per_expert_bf16", SHAPE, 72, module="linear"),
    scenarios.scenario(
        "fp8_linear_packed_fp32_dcp_stale",
        SHAPE,
        73,
        module="linear",
        packed=True,
        bf16=False,
        reshard=False,
        dcp=True,
        steps=3,
        momentum=0.9,
        fp8_cache="stale",
    ),
]
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
    cfg, ranks, expected = _scenario(name), runs(2)[name], _replay(name)
    for step in range(cfg["steps"]):
        for param, grad in ranks[0]["grads"][step].items():
            assert torch.equal(ranks[1]["grads"][step][param], grad), (param, step)
    for rank, result in enumerate(ranks):
        for i, (out, dx) in enumerate(zip(result["outs"], result["dxs"], strict=True)):
            step, micro = divmod(i, cfg["micro_batches"])
            key = (step, rank, micro)
            scenarios.close(out, expected["outs"][key], f"{name} output {key}")
            scenarios.close(dx, expected["dxs"][key], f"{name} input grad {key}")
    for step in range(cfg["steps"]):
        for param, grad in ranks[0]["grads"][step].items():
            scenarios.close(grad, expected["grads"][step][param], f"{name} grad {param} {step}")
        for param, weight in ranks[0]["weights"][step].items():
            want = expected["weights"][step][param]
            scenarios.close(weight, want, f"{name} weight {param} after step {step}")


@pytest.mark.parametrize("name", NAMES)
def test_the_experts_really_ran_in_fp8(runs: Launches, name: str) -> None:
    """The expert gradients differ from an unquantized fp64 replay's by FP8's error, not 1e-5."""
    cfg, ranks = _scenario(name), runs(2)[name]
    unquantized = reference.replay(cfg, init(cfg), 2, torch.float64, moe_model)
    for param, grad in ranks[0]["grads"][0].items():
        if scenarios.is_expert(param) and ".weight" in param:
            want = unquantized["grads"][0][param]
            error = float((grad.double() - want).abs().max() / want.abs().max())
            assert 1e-3 < error < 0.2, (param, error)


@pytest.mark.parametrize("name", NAMES)
def test_fp8_units_reduce_scatter_fp32_never_rounded_to_bf16(runs: Launches, name: str) -> None:
    cfg, ranks = _scenario(name), runs(2)[name]
    fractions = scenarios.check_reduce_scatters(cfg, ranks, reduce_scatter)
    experts = [f for found in fractions.values() for f in found["experts"]]
    assert experts, fractions
    if cfg["bf16"] and not cfg["empty_expert"]:  # an unused expert's zeros are bf16 values
        assert max(experts) < 0.05, fractions  # bf16-rounded wgrads: 1.0


def init(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in moe_model.build(cfg).named_parameters()}
