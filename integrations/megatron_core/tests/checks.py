"""What the parent tests assert on the ranks' layer results, in one place.

Every expectation comes from an independent computation: Megatron's own
``SequentialMLP`` layer run on the same weights and inputs (fp32), and the
same ``SequentialMLP`` layer run in fp64 (the truth for bf16 runs, against
which groupgrad's error may be at most twice ``SequentialMLP``'s own bf16
error, plus a small atol: DESIGN's rule, ``assert_as_close_as_torch``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from groupgrad_testsupport import assert_as_close_as_torch, assert_within_scale, max_abs_error

FP32_REL = 1e-5
"""fp32: |groupgrad - SequentialMLP| allowed, relative to the tensor's largest |value|."""

BF16_RTOL = 2.0**-7
"""bf16 rule's small atol, relative to the fp64 tensor's largest |value|: one bf16 rounding step there.

bf16 keeps 8 significant bits, so two sound bf16 computations of the same
value may land one rounding step apart at the tensor's magnitude; on the
small tensors of these tests the largest error of either is a few such steps,
and their ratio alone is noise (measured: a fused-vs-Megatron error ratio of
up to 2.4 on single expert GEMMs whose median ratio is 1.0).
"""


def named_tensors(run: dict[str, Any]) -> dict[str, Tensor]:
    """One layer run's tensors by name: ``out0``, ``out1``, ``dx0``, ``dx1``, ``main_grad:<param>``."""
    tensors = {f"out{i}": t for i, t in enumerate(run["out"])}
    tensors.update({f"dx{i}": t for i, t in enumerate(run["dx"])})
    tensors.update({f"main_grad:{k}": t for k, t in run["main_grad"].items()})
    return tensors


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """``max |actual - expected| / max |expected|`` (float64)."""
    return max_abs_error(actual, expected) / max(float(expected.double().abs().max()), 1e-30)


def assert_matches_sequential(result: dict[str, Any], where: str, rel: float = FP32_REL) -> float:
    """Outputs, input grads and every main_grad equal SequentialMLP's to ``rel``; the worst ratio."""
    ours, theirs = named_tensors(result["groupgrad"]), named_tensors(result["sequential"])
    assert sorted(ours) == sorted(theirs), f"{where}: {sorted(ours)} vs {sorted(theirs)}"
    worst = 0.0
    for name, expected in theirs.items():
        scale = float(expected.double().abs().max())
        assert scale > 0, f"{where}: SequentialMLP's {name} is all zeros; the test could not fail"
        assert_within_scale(ours[name], expected, rel=rel, atol=0.0, what=f"{where} {name}")
        worst = max(worst, relative_error(ours[name], expected))
    return worst


def assert_bf16_within_twice_sequential(result: dict[str, Any], where: str) -> float:
    """DESIGN's bf16 rule against the fp64 run, for every tensor; the worst error ratio."""
    ours, theirs = named_tensors(result["groupgrad"]), named_tensors(result["sequential"])
    truth = named_tensors(result["fp64"])
    assert sorted(ours) == sorted(theirs) == sorted(truth), where
    worst = 0.0
    for name, exact in truth.items():
        scale = float(exact.abs().max())
        assert scale > 0, f"{where}: the fp64 {name} is all zeros; the test could not fail"
        assert_as_close_as_torch(
            ours[name], exact, theirs[name], atol=0.0, rtol=BF16_RTOL, what=f"{where} {name}"
        )
        bound = 2 * max_abs_error(theirs[name], exact) + BF16_RTOL * scale
        worst = max(worst, max_abs_error(ours[name], exact) / bound)
    return worst


def assert_fp8_step_requantizes(result: dict[str, Any]) -> None:
    """``fp8_worker``'s ``step``: the first micro-batch after each optimizer step quantizes afresh.

    Catches the experts ignoring Megatron's ``is_first_microbatch`` (a stale
    FP8 weight after ``DistributedOptimizer.step()``, which writes the weights
    without moving their version).
    """
    assert result["steps_ok"] == [True, True]
    assert result["flags"] == [True, False, True, False]  # cached within a step, then refreshed
    assert result["weights_moved"], "the optimizer step left the expert weights unchanged"
    assert not result["versions_moved"], "the version guard alone would have seen this step"
    for i, (y, fresh) in enumerate(zip(result["y"], result["fresh"], strict=True)):
        assert torch.equal(y, fresh), f"forward {i}: not its step's weights, quantized afresh"
    stale = result["step2_with_step1_weights"]
    assert not torch.equal(result["y"][2], stale), "the test cannot tell stale weights from new"


def assert_first_and_last_layers_bf16(result: dict[str, Any]) -> None:
    """``fp8_worker``'s ``bf16_layers``: layers 1 and 3 equal a bf16 ``GroupedMLP``, layer 2 an FP8 one."""
    for number, recipe in [(1, "None"), (2, "blockwise"), (3, "None")]:
        other = "blockwise" if recipe == "None" else "None"
        assert torch.equal(result[f"layer{number}"], result[f"layer{number}-{recipe}"]), number
        assert not torch.equal(result[f"layer{number}"], result[f"layer{number}-{other}"]), number
