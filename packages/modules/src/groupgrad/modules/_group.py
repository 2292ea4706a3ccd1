"""A grouped layer's weights as the GEMMs see them, and its wgrad step.

Legend: ``T`` tokens, ``E`` experts (groups), ``K`` in_features,
``N`` out_features.

A layer's parameters come in one of two layouts — ``E`` per-expert ``(N, K)``
parameters, or one packed ``(E, N, K)`` parameter — and may be plain or led by
a ``DistributedWeight``. :class:`WeightGroupSpec` records the layout once, so
the autograd Functions never branch on it; :func:`run_wgrad` resolves the
``main_grad`` contract into a plan (``groupgrad.protocol``) and runs the GEMM
into it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from groupgrad.kernels import grouped_wgrad
from groupgrad.protocol import (
    accumulate_grads_like_autograd,
    defer_weight_grads,
    plan_weight_grads,
)

__all__ = [
    "DeferredWgrad",
    "WeightGroupSpec",
    "WgradQueue",
    "expert_index",
    "run_wgrad",
    "wgrad_step",
]


@dataclass(frozen=True)
class WeightGroupSpec:
    """How one layer's weight parameters map onto a grouped GEMM.

    Attributes:
        names: Parameter names, leader first (``weight0 …`` or ``weight``),
            for error messages.
        packed: One ``(E, N, K)`` parameter holds every expert (else one
            ``(N, K)`` parameter per expert).
        wgrad_into_main_grad: The layer writes its wgrad into ``main_grad``
            (its ``accumulate_into_main_grad`` option).
    """

    names: tuple[str, ...]
    packed: bool
    wgrad_into_main_grad: bool

    def gemm_weights(self, materialized: Sequence[Tensor]) -> Tensor | list[Tensor]:
        """The materialized weights in the form the grouped kernels take."""
        return materialized[0] if self.packed else list(materialized)

    def num_groups(self, materialized: Sequence[Tensor]) -> int:
        """``E``, read off the materialized weights."""
        return materialized[0].shape[0] if self.packed else len(materialized)


def expert_index(
    splits: Sequence[int] | Tensor, num_groups: int, rows: int, device: torch.device
) -> Tensor:
    """Return ``(T,)`` int64: the expert each row belongs to, without a host sync.

    Args:
        splits: ``E`` token counts (sequence, CPU tensor or device tensor).
        num_groups: ``E``.
        rows: ``T``, the number of rows (``sum(splits)``).
        device: Where the index lives.
    """
    counts = torch.as_tensor(splits, dtype=torch.int64)
    if counts.device != device:
        counts = counts.to(device, non_blocking=True)
    experts = torch.arange(num_groups, device=device)
    return torch.repeat_interleave(experts, counts, output_size=rows)


def run_wgrad(
    spec: WeightGroupSpec,
    shape: tuple[int, ...],
    params: Sequence[Tensor],
    dy_TN: Tensor,
    x_TK: Tensor,
    splits: Sequence[int] | Tensor,
    *,
    deferred: bool = False,
) -> list[Tensor | None]:
    """Run one group's wgrad GEMM as the ``main_grad`` contract says.

    The plan (made now, so ``overwrite_main_grad`` and ``get_main_grad()`` are
    read now) names the GEMM's output buffers, dtype and accumulate flag; the
    kernel writes there through its epilogue (``main_grad`` itself when the
    layer writes into it).

    Args:
        spec: The layer's weight layout.
        shape: One parameter's full wgrad shape: the materialized weight's
            shape, ``(N, K)`` or packed ``(E, N, K)``.
        params: The layer's parameters (not materialized copies), leader first.
        dy_TN: ``(T, N)`` output gradient.
        x_TK: ``(T, K)`` input.
        splits: ``E`` token counts.
        deferred: Running in ``backward_dw()``: the result is delivered to
            ``.grad`` here (as autograd would) instead of being returned.

    Returns:
        What autograd receives for each parameter (all ``None`` when deferred).
    """
    plan = plan_weight_grads(
        params,
        shape=shape,
        compute_dtype=dy_TN.dtype,
        device=dy_TN.device,
        wgrad_into_main_grad=spec.wgrad_into_main_grad,
        deferred=deferred,
        names=spec.names,
    )
    grouped_wgrad(dy_TN, x_TK, splits, out=plan.gemm_out, accumulate=plan.accumulate)
    grads = plan.finish()
    if not deferred:
        return grads
    accumulate_grads_like_autograd(params, grads)
    return [None] * len(params)


@dataclass(frozen=True)
class DeferredWgrad:
    """One group's wgrad GEMM, queued by backward for ``backward_dw()``."""

    spec: WeightGroupSpec
    shape: tuple[int, ...]
    params: tuple[Tensor, ...]
    dy_TN: Tensor
    x_TK: Tensor
    splits: Sequence[int] | Tensor

    def run(self) -> None:
        """Run the GEMM now, finalize distributed weights and deliver to ``.grad``."""
        run_wgrad(
            self.spec, self.shape, self.params, self.dy_TN, self.x_TK, self.splits, deferred=True
        )


def wgrad_step(
    spec: WeightGroupSpec,
    shape: tuple[int, ...],
    params: Sequence[Tensor],
    dy_TN: Tensor,
    x_TK: Tensor,
    splits: Sequence[int] | Tensor,
    deferred: list[DeferredWgrad] | None,
) -> list[Tensor | None]:
    """Backward's wgrad step for one group: what autograd receives for its parameters.

    Trainability is read from the parameters: a group none of whose
    parameters requires grad runs nothing. With ``deferred`` (a list), the
    GEMM is appended there for ``backward_dw()`` and autograd receives
    :func:`~groupgrad.protocol.defer_weight_grads`; otherwise it runs now.
    """
    if not any(param.requires_grad for param in params):
        return [None] * len(params)
    if deferred is None:
        return run_wgrad(spec, shape, params, dy_TN, x_TK, splits)
    deferred.append(DeferredWgrad(spec, shape, tuple(params), dy_TN, x_TK, splits))
    return defer_weight_grads(
        params, wgrad_into_main_grad=spec.wgrad_into_main_grad, names=spec.names
    )


class WgradQueue:
    """FIFO of deferred wgrad GEMMs (``delay_wgrad_compute=True``), one job per backward.

    Each backward pushes one job (the wgrads of every weight group it
    deferred); each ``backward_dw()`` runs the oldest job.
    """

    def __init__(self) -> None:
        self._jobs: collections.deque[list[DeferredWgrad]] = collections.deque()

    def __len__(self) -> int:
        return len(self._jobs)

    def push(self, job: list[DeferredWgrad]) -> None:
        """Queue the deferred wgrads of one backward (nothing for an empty job)."""
        if job:
            self._jobs.append(job)

    def pop_and_run(self, owner: str) -> None:
        """Run the oldest backward's deferred wgrads.

        Raises:
            RuntimeError: No backward has queued anything.
        """
        if not self._jobs:
            raise RuntimeError(
                f"{owner}.backward_dw() was called but no backward has queued a weight "
                "gradient; call it once after each backward"
            )
        for entry in self._jobs.popleft():
            entry.run()
