"""The single-process fp64 reference the ``mfsdp_worker.py`` ranks are compared with.

The reference recomputes, in one process and in float64 with plain autograd
on the full weights, what Megatron-FSDP training should produce: per step,
the gradient summed over micro-batches and averaged over ranks (Megatron-FSDP
scales by ``1/world`` before the reduction), then an SGD update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from groupgrad_testsupport import assert_as_close_as_torch, assert_close


def _expert(weights: dict[str, Tensor], prefix: str, e: int, packed: bool) -> Tensor:
    return weights[f"{prefix}.weight"][e] if packed else weights[f"{prefix}.weight{e}"]


def forward(
    cfg: dict[str, Any], w: dict[str, Tensor], x: Tensor, splits: list[int], probs: Tensor
) -> Tensor:
    """The worker's ``Net`` in plain PyTorch: ``GroupedMLP(tanh(GroupedLinear(x)))`` per expert."""
    f = cfg["ffn_hidden"]
    outs = []
    for e, (x_e, p_e) in enumerate(zip(x.split(splits), probs.split(splits), strict=True)):
        h = torch.tanh(x_e @ w[f"proj.weight{e}"].T + w[f"proj.bias{e}"])
        h1 = h @ _expert(w, "mlp.fc1", e, cfg["packed"]).T
        act = torch.nn.functional.silu(h1[:, :f]) * h1[:, f:] * p_e[:, None]
        outs.append(act @ _expert(w, "mlp.fc2", e, cfg["packed"]).T)
    return torch.cat(outs)


def expected_weights(
    ranks: list[dict[str, Any]],
    *,
    last_micro_only: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> list[dict[str, Tensor]]:
    """Full fp64 weights after each SGD step, from the inputs every rank recorded.

    See :func:`expected_steps` for the arguments.
    """
    return [weights for weights, _ in expected_steps(ranks, last_micro_only, compute_dtype)]


def expected_grads(ranks: list[dict[str, Any]]) -> list[dict[str, Tensor]]:
    """Each step's full reduced gradient: summed over micro-batches, averaged over ranks (fp64)."""
    return [grads for _, grads in expected_steps(ranks)]


def expected_steps(
    ranks: list[dict[str, Any]],
    last_micro_only: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> list[tuple[dict[str, Tensor], dict[str, Tensor]]]:
    """Full fp64 weights after each SGD step and the reduced gradient of that step.

    Args:
        ranks: One worker result per rank.
        last_micro_only: Model the Megatron-FSDP pitfall: the groupgrad
            weights keep only each step's last micro-batch gradient (earlier
            ones overwritten); other parameters keep the sum.
        compute_dtype: The dtype forward and backward run in (``bfloat16``
            gives PyTorch's own bf16 computation, the yardstick of the bf16
            rule); gradients are summed and weights updated in float64.
    """
    cfg = ranks[0]["config"]
    world, micro = len(ranks), cfg["micro_batches"]
    weights = {n: t.clone() for n, t in ranks[0]["init"].items()}
    groupgrad = set(ranks[0]["weight_names"])
    after = []
    for step in range(cfg["steps"]):
        grads = {n: torch.zeros_like(t) for n, t in weights.items()}
        for result in ranks:
            for m in range(micro):
                batch = result["data"][step * micro + m]
                leaves = {
                    n: t.to(compute_dtype, copy=True).requires_grad_() for n, t in weights.items()
                }
                dtype = getattr(torch, cfg.get("dtype", "float32"))
                x, probs, dy = (batch[k].to(dtype).to(compute_dtype) for k in ("x", "probs", "dy"))
                (forward(cfg, leaves, x, batch["splits"], probs) * dy).sum().backward()
                for n, leaf in leaves.items():
                    assert leaf.grad is not None
                    if last_micro_only and n in groupgrad and m < micro - 1:
                        continue
                    grads[n] += leaf.grad.double()
        reduced = {n: g / world for n, g in grads.items()}
        weights = {n: t - cfg["lr"] * reduced[n] for n, t in weights.items()}
        after.append((weights, reduced))
    return after


def check_weights(
    ranks: list[dict[str, Any]], expected: list[dict[str, torch.Tensor]], *, tol: float = 1e-5
) -> None:
    """Every rank's full weights after every step equal ``expected`` within ``tol`` (rtol and atol)."""
    name = ranks[0]["config"]["name"]
    for rank, result in enumerate(ranks):
        assert len(result["weights"]) == len(expected), f"{name} rank {rank}: step count"
        for step, (got, want) in enumerate(zip(result["weights"], expected, strict=True)):
            assert got.keys() == want.keys(), f"{name}: parameter names differ"
            for param, tensor in got.items():
                where = f"{name} rank {rank} step {step} {param}"
                assert not tensor.isnan().any(), f"{where} has NaN (a chunk was never gathered)"
                assert_close(tensor, want[param], rtol=tol, atol=tol / 10, what=where)


def check_main_grad_calls(ranks: list[dict[str, Any]], overwrite: bool) -> None:
    """One fp32 ``get_main_grad()`` per groupgrad weight per backward, with the expected flag."""
    name = ranks[0]["config"]["name"]
    for rank, result in enumerate(ranks):
        for micro, calls in enumerate(result["calls"]):
            where = f"{name} rank {rank} micro-batch {micro}"
            called = sorted(call["param"] for call in calls)
            assert called == sorted(result["weight_names"]), (
                f"{where}: get_main_grad() calls {called}, expected one per groupgrad weight"
            )
            for call in calls:
                assert call["dtype"] == "torch.float32", f"{where} {call['param']}: {call}"
                assert call["overwrite"] is overwrite, (
                    f"{where} {call['param']}: overwrite_main_grad={call['overwrite']}, "
                    f"expected {overwrite}"
                )


def check_weights_bf16(ranks: list[dict[str, Any]]) -> None:
    """bf16 rule: each weight errs at most twice PyTorch's own bf16 computation, plus 1e-4."""
    exact = expected_weights(ranks)
    torch_bf16 = expected_weights(ranks, compute_dtype=torch.bfloat16)
    name = ranks[0]["config"]["name"]
    for rank, result in enumerate(ranks):
        for step, got in enumerate(result["weights"]):
            for param, tensor in got.items():
                where = f"{name} rank {rank} step {step} {param}"
                assert_as_close_as_torch(
                    tensor, exact[step][param], torch_bf16[step][param], atol=1e-4, what=where
                )


def check_gathered(ranks: list[dict[str, Any]], *, tol: float = 1e-5) -> None:
    """``gather_full_weights`` / ``gather_full_grads`` on every rank, after every step.

    The gathered weights equal the worker's own assembly exactly; the gathered
    gradients equal the fp64 reduced gradient within ``tol`` (fp32 training)
    or, in bf16, err at most twice PyTorch's own bf16 computation plus 1e-4.
    Every parameter is present: none lacks a gradient here.
    """
    name = ranks[0]["config"]["name"]
    bf16 = ranks[0]["config"].get("dtype") == "bfloat16"
    exact = expected_grads(ranks)
    torch_bf16 = (
        [g for _, g in expected_steps(ranks, compute_dtype=torch.bfloat16)] if bf16 else exact
    )
    for rank, result in enumerate(ranks):
        for step, (own, gathered) in enumerate(
            zip(result["weights"], result["gathered_weights"], strict=True)
        ):
            assert gathered.keys() == own.keys(), f"{name} rank {rank} step {step}: names"
            for param, tensor in gathered.items():
                assert torch.equal(tensor.double(), own[param]), (
                    f"{name} rank {rank} step {step} {param}: gather_full_weights differs "
                    "from the worker's own assembly"
                )
        for step, grads in enumerate(result["gathered_grads"]):
            assert grads.keys() == exact[step].keys(), (
                f"{name} rank {rank} step {step}: gradients of {sorted(grads)}, expected "
                f"{sorted(exact[step])}"
            )
            for param, grad in grads.items():
                where = f"{name} rank {rank} step {step} {param}"
                assert not grad.isnan().any(), f"{where}: NaN (a piece was never placed)"
                want = exact[step][param]
                if not bf16:
                    torch.testing.assert_close(
                        grad.double(),
                        want,
                        rtol=tol,
                        atol=tol / 10,
                        msg=lambda m, w=where: f"{w}: {m}",
                    )
                    continue
                ours = (grad.double() - want).abs().max().item()
                theirs = (torch_bf16[step][param] - want).abs().max().item()
                assert ours <= 2 * theirs + 1e-4, f"{where}: error {ours:.3g}, bf16 {theirs:.3g}"
