"""Megatron-Core's reentrant recompute around groupgrad experts used in two regions of one forward.

Megatron's ``tensor_parallel.checkpoint(fn, False, *args)`` (its
``CheckpointFunction``, also what ``recompute_modules=["moe"]`` wraps the MoE
layer in) runs ``fn`` without grad in the forward, recomputes it inside the
outer backward and backwards through it with ``torch.autograd.backward``:
a nested autograd graph task per region. groupgrad counts "one backward" by
graph task (one ``backward_dw()`` job per backward; the first GEMM into a
``main_grad`` that asks to be overwritten overwrites, the others add), so the
nested tasks must count as the backward that recomputed them.

One gloo rank (the test-only ``cpu_shim``, Megatron's allgather dispatcher):
the same Megatron ``MoELayer`` with groupgrad experts (fused, and
``TEGroupedMLP`` with groupgrad grouped linears) under Megatron's DDP runs
two inputs, each in a region of its own, and one ``.backward()`` of the sum;
its outputs, input gradients and every ``main_grad`` must equal those of an
identical layer running both inputs without recompute. With
``delay_wgrad_compute`` the test calls the experts' ``backward_dw()`` once
after the backward, and a second call must find nothing queued.

This file is its own worker (``__main__`` below), as a rank of the
``Launches`` fixture: the Megatron helpers come from ``mcore_worker.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from groupgrad_testsupport import Launches, load_sibling

mcore_worker = load_sibling(__file__, "mcore_worker")
checks = load_sibling(__file__, "checks")

ROUTES = ("autograd", "fusion", "overwrite")
"""``autograd``: ``gradient_accumulation_fusion=False`` (the wgrad to autograd, DDP's hook adds
it); ``fusion``: the GEMMs add into ``main_grad``; ``overwrite``: fusion with
``overwrite_main_grad`` on every expert weight (the semantics Megatron-FSDP asks for, set here
by hand under DDP) and its ``main_grad`` NaN before the backward, whose first GEMM overwrites."""

SCENARIOS = [
    {
        "name": f"{backend}-{route}-{'delay' if delay else 'nodelay'}-checkpoint",
        "backend": backend,
        "route": route,
        "delay": delay,
        "recompute": "checkpoint",  # the test's own tensor_parallel.checkpoint around the layer
        "ep": 1,
    }
    for backend in ("fused", "unfused")
    for route in ROUTES
    for delay in (False, True)
] + [
    {
        "name": f"{backend}-fusion-delay-moe-recompute",
        "backend": backend,
        "route": "fusion",
        "delay": True,
        "recompute": "moe",  # Megatron's selective recompute of the MoE layer
        "ep": 1,
    }
    for backend in ("fused", "unfused")
]


# ---------------------------------------------------------------- worker side


def _build(sc: dict[str, Any], *, recompute: bool) -> Any:
    """The scenario's MoE layer (Megatron's recompute of it for ``recompute="moe"``)."""
    mcore_worker.setup_parallel(1)
    selective = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
    config = mcore_worker.make_config(
        sc,
        torch.float32,
        gradient_accumulation_fusion=sc["route"] != "autograd",
        delay_wgrad_compute=sc["delay"],
        **(selective if recompute and sc["recompute"] == "moe" else {}),
    )
    return mcore_worker.build_layer(sc["backend"], config, "cpu")


def _run(sc: dict[str, Any], layer: Any, *, recompute: bool) -> dict[str, Any]:
    """Both inputs through ``layer`` (each in a checkpointed region if ``recompute``), one
    backward; outputs, input grads, every ``main_grad``, what a second ``backward_dw()`` says."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import checkpoint

    config = layer.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, delay_wgrad_compute=sc["delay"]
    )
    ddp = DistributedDataParallel(config, ddp_config, layer)
    if sc["route"] == "overwrite":
        for name, param in layer.named_parameters():
            if name.startswith("experts.") and name.rsplit(".", 1)[-1].startswith("weight"):
                param.overwrite_main_grad = True
                param.main_grad.fill_(float("nan"))
    forwards: list[bool] = []  # grad mode of every experts forward
    layer.experts.register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))

    def region(x: torch.Tensor) -> torch.Tensor:
        return ddp(x)[0]

    data = [mcore_worker._data(sc, use, "cpu") for use in range(2)]
    xs = [x.requires_grad_() for x, _ in data]  # a reentrant region backwards only then
    if recompute and sc["recompute"] == "checkpoint":
        outs = [checkpoint(region, False, x) for x in xs]
    else:
        outs = [region(x) for x in xs]
    sum((out * dy).sum() for out, (_, dy) in zip(outs, data, strict=True)).backward()
    if sc["delay"]:
        layer.experts.backward_dw()  # once: one backward
    ddp.finish_grad_sync()
    result = {
        "out": [out.detach().clone() for out in outs],
        "dx": [x.grad.detach().clone() for x in xs],
        "main_grad": {n: p.main_grad.detach().clone() for n, p in layer.named_parameters()},
        "forwards": forwards,
    }
    if sc["delay"]:  # after the main_grads were read: a second job would run here
        result["second_backward_dw"] = mcore_worker._message(layer.experts.backward_dw)
    return result


def run_scenario(sc: dict[str, Any], rank: Any) -> dict[str, Any]:
    """The layer with recompute, then an identical one (its weights loaded) without."""
    recomputing = _build(sc, recompute=True)
    plain = _build(sc, recompute=False)
    plain.load_state_dict(recomputing.state_dict())
    return {
        "recomputed": _run(sc, recomputing, recompute=True),
        "plain": _run(sc, plain, recompute=False),
    }


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, Path(__file__), {1: SCENARIOS}, timeout_s=300)


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_recomputed_uses_get_the_gradients_of_one_backward(runs: Launches, name: str) -> None:
    """Catches: groupgrad.modules before the fix (a grouped Function's backward in a reentrant
    checkpoint's nested graph task counted as a backward of its own, no ``enter_backward``):
    with ``overwrite_main_grad`` each region's first GEMM overwrote ``main_grad`` (the first
    region's gradient alone was left); with ``delay_wgrad_compute`` the backward queued a job
    per region and the one ``backward_dw()`` delivered the second region's wgrads only. The
    accumulating routes without delay passed before the fix too: there the test catches a
    recompute that drops or doubles a region's gradient (a fix that takes a nested backward's
    GEMM for one already done)."""
    (result,) = runs(1)[name]
    recomputed, plain = result["recomputed"], result["plain"]
    # the reentrant path ran: each region's forward without grad, recomputed in the backward
    assert plain["forwards"] == [True, True], name
    assert recomputed["forwards"] == [False, False, True, True], name
    ours, theirs = checks.named_tensors(recomputed), checks.named_tensors(plain)
    assert sorted(ours) == sorted(theirs), name
    assert any(key.startswith("main_grad:experts.") for key in theirs), name
    for key, expected in theirs.items():
        assert expected.abs().max() > 0, f"{name}: {key} is all zeros; the test could not fail"
        # Exact, not to an fp32 tolerance: the recompute repeats the forward bit for bit, the
        # backward runs the same GEMMs, and each gradient is the two uses' contributions
        # summed onto a zero (or overwritten) buffer: two fp32 terms, equal in either order.
        assert torch.equal(ours[key], expected), (
            f"{name}: {key} with recompute differs from the same layer without: max |diff| "
            f"{(ours[key] - expected).abs().max()} (max |value| {expected.abs().max()})"
        )


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS if s["delay"]])
def test_one_backward_leaves_one_backward_dw_job(runs: Launches, name: str) -> None:
    """Catches: groupgrad.modules before the fix: one ``.backward()`` through two recomputed
    regions queued two ``backward_dw()`` jobs (a nested graph task per region), so the second
    ``backward_dw()`` ran a job where it must raise (nothing left queued)."""
    (result,) = runs(1)[name]
    for run in ("recomputed", "plain"):
        second = result[run]["second_backward_dw"]
        assert second.startswith("RuntimeError:"), f"{name} {run}: second backward_dw(): {second}"
        assert "no backward has queued a weight gradient" in second, f"{name} {run}: {second}"


if __name__ == "__main__":
    from groupgrad_testsupport import run_worker

    run_worker(run_scenario, setup=mcore_worker.install_cpu_shim)
