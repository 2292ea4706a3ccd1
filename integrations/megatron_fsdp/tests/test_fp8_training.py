"""FP8 (``fp8_recipe="blockwise"``) groupgrad layers trained under the real Megatron-FSDP, 2 gloo ranks.

The worker of ``test_training.py`` builds its ``GroupedMLP(tanh(GroupedLinear(x)))``
with both layers in FP8 (hidden and expert width 128, the FP8 blocks' size),
``accumulate_into_main_grad=True``, shards it with ``shard_model`` under
ZeRO-3 (per-expert and packed) and ZeRO-1 (the persistent, unsharded
gradient buffer: micro-batches accumulate into it), and trains 2 SGD steps
of 2 micro-batches. The parent replays the run with the same FP8 layers
unsharded in one process (``fp8_reference.py`` says why that oracle is
exact): the weights after every step and the gathered reduced gradients
agree to 1e-5; each FP8 wgrad went through ``get_main_grad()`` once per
backward into an fp32 buffer, and every gradient collective ran in fp32.

The ``stale`` scenarios pass ``is_first_microbatch=True`` at the first
forward and ``False`` at every later one, across optimizer steps:
Megatron-FSDP's weights are re-gathered at every forward and must never be
served from the FP8 cache, so they too must equal the replay.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from groupgrad_testsupport import Launches, assert_close, load_sibling

ref = load_sibling(__file__, "reference")
fp8_ref = load_sibling(__file__, "fp8_reference")
WORKER = Path(__file__).with_name("mfsdp_worker.py")

SHAPE = {"experts": 3, "hidden": 128, "ffn_hidden": 128, "tokens": 48, "fp8": True}
DEFAULTS = {"packed": False, "fixed": True, "steps": 2, "micro_batches": 2, "lr": 0.5}


def scenario(name: str, strategy: str, seed: int, **options: Any) -> dict[str, Any]:
    return {"name": name, **DEFAULTS, **SHAPE, "strategy": strategy, "seed": seed, **options}


FP8 = [
    scenario("fp8-zero3-per_expert-stale", "optim_grads_params", 21, fp8_cache="stale"),
    scenario("fp8-zero3-packed", "optim_grads_params", 22, packed=True),
    scenario("fp8-zero1-packed-stale", "optim", 23, packed=True, fp8_cache="stale"),
]
NAMES = [s["name"] for s in FP8]
SHARDED = {"fp8-zero3-per_expert-stale", "fp8-zero3-packed"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict[str, Any]]:
    return Launches(tmp_path_factory, WORKER, {2: FP8})


@pytest.mark.parametrize("name", NAMES)
def test_fp8_weights_and_grads_match_the_unsharded_fp8_replay(
    runs: Callable[[int], dict[str, Any]], name: str
) -> None:
    ranks = runs(2)[name]
    expected = fp8_ref.expected_steps(ranks)
    ref.check_weights(ranks, [weights for weights, _ in expected])
    for rank, result in enumerate(ranks):
        for step, grads in enumerate(result["gathered_grads"]):
            assert grads.keys() == expected[step][1].keys(), (name, rank, step)
            for param, grad in grads.items():
                want = expected[step][1][param]
                limit = 1e-5 * float(want.abs().max())
                where = f"{name} rank {rank} step {step} {param}"
                assert_close(grad, want, rtol=0.0, atol=limit, what=where)


@pytest.mark.parametrize("name", NAMES)
def test_the_layers_really_ran_in_fp8(runs: Callable[[int], dict[str, Any]], name: str) -> None:
    """The weights differ from an unquantized fp64 replay's by FP8's error, not by 1e-5."""
    ranks = runs(2)[name]
    unquantized = ref.expected_weights(ranks)[-1]
    initial = ranks[0]["init"]
    for param, got in ranks[0]["weights"][-1].items():
        if ".weight" not in param:
            continue
        step = unquantized[param] - initial[param]  # what training moved, unquantized
        error = float((got - unquantized[param]).abs().max() / step.abs().max())
        assert 1e-3 < error < 0.5, (param, error)


@pytest.mark.parametrize("name", NAMES)
def test_fp8_wgrads_go_through_get_main_grad_once_in_fp32(
    runs: Callable[[int], dict[str, Any]], name: str
) -> None:
    ranks = runs(2)[name]
    ref.check_main_grad_calls(ranks, overwrite=name in SHARDED)
    for rank, result in enumerate(ranks):
        assert result["collectives"], f"{name} rank {rank}: no gradient collective ran"
        for entry in result["collectives"]:
            assert entry["dtype"] == str(torch.float32), f"{name} rank {rank}: {entry}"
