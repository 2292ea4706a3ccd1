"""A grouped layer's weights as the GEMMs see them, and its wgrad step.

Legend: ``T`` tokens, ``E`` experts (groups), ``K`` in_features,
``N`` out_features.

A layer's parameters come in one of two layouts — ``E`` per-expert ``(N, K)``
parameters, or one packed ``(E, N, K)`` parameter — and may be plain or led by
a ``DistributedWeight``. :class:`WeightGroupSpec` records the layout once, so
the autograd Functions never branch on it; :func:`run_wgrad` resolves the
``main_grad`` contract into a plan (``groupgrad.protocol``) and runs the GEMM
into it.

What a backward uses later is pinned at forward: :func:`snapshot_splits`
copies the token counts (a caller may refill its buffer at once), and a
deferred wgrad (:class:`DeferredWgrad`) checks, as autograd checks saved
tensors, that its operands were not changed in place before it runs.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from groupgrad.kernels import grouped_wgrad
from groupgrad.protocol import (
    WeightGradPlan,
    WgradRoute,
    accumulate_grads_like_autograd,
    defer_weight_grads,
    plan_weight_grads,
    wgrad_route,
)

__all__ = [
    "DeferredWgrad",
    "Splits",
    "WeightGroupSpec",
    "WgradQueue",
    "as_gemm_dtype",
    "autocast_dtype",
    "early_plan",
    "expert_index",
    "no_autocast",
    "run_wgrad",
    "snapshot_splits",
    "wgrad_step",
]

Splits = Sequence[int] | Tensor
"""``E`` token counts: a sequence of ints, a CPU tensor or a device tensor."""


def snapshot_splits(splits: Splits) -> Splits:
    """A private copy of ``splits``, taken at forward for every later GEMM of the op.

    A sequence becomes a tuple; a tensor is cloned where it lives (on the
    device without a host sync, so the CUDA-graph path stays capturable).
    Values are checked by the kernels, not here.
    """
    if isinstance(splits, Tensor):
        return splits.clone()
    if isinstance(splits, Sequence) and not isinstance(splits, str | bytes):
        return tuple(splits)
    return splits  # not a token count container: the kernels name the problem


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` asks for on ``x``'s device, or ``None`` when it is off."""
    device_type = x.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


@contextlib.contextmanager
def no_autocast(device: torch.device) -> Iterator[None]:
    """Autocast off on ``device`` inside an op's own forward and backward.

    The op casts its operands itself (to :func:`autocast_dtype`); the reference
    kernels and the elementwise steps must run in the dtypes they are given.
    """
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        with torch.autocast(device.type, enabled=False):
            yield
    else:
        yield


def as_gemm_dtype(tensors: Sequence[Tensor], dtype: torch.dtype | None) -> list[Tensor]:
    """``tensors`` cast to autocast's ``dtype`` (unchanged when ``dtype`` is ``None``).

    Without autocast nothing is cast: operands of different dtypes are the
    kernels' to reject, as ``nn.Linear`` rejects them.
    """
    if dtype is None:
        return list(tensors)
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


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


def expert_index(splits: Splits, num_groups: int, rows: int, device: torch.device) -> Tensor:
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
    splits: Splits,
    *,
    deferred: bool = False,
    plan: WeightGradPlan | None = None,
) -> list[Tensor | None]:
    """Run one group's wgrad GEMM as the ``main_grad`` contract says.

    The plan (made now unless :func:`early_plan` made it, so
    ``overwrite_main_grad`` and ``get_main_grad()`` are read now) names the
    GEMM's output buffers, dtype and accumulate flag; the kernel writes there
    through its epilogue (``main_grad`` itself when the layer writes into it).

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
        plan: A plan :func:`early_plan` made for this GEMM, or ``None``.

    Returns:
        What autograd receives for each parameter (all ``None`` when deferred).
    """
    if plan is None:
        plan = _plan(spec, shape, params, dy_TN.dtype, dy_TN.device, deferred)
    grouped_wgrad(dy_TN, x_TK, splits, out=plan.gemm_out, accumulate=plan.accumulate)
    grads = plan.finish()
    if not deferred:
        return grads
    accumulate_grads_like_autograd(params, grads)
    return [None] * len(params)


def _plan(
    spec: WeightGroupSpec,
    shape: tuple[int, ...],
    params: Sequence[Tensor],
    dtype: torch.dtype,
    device: torch.device,
    deferred: bool,
) -> WeightGradPlan:
    return plan_weight_grads(
        params,
        shape=shape,
        compute_dtype=dtype,
        device=device,
        wgrad_into_main_grad=spec.wgrad_into_main_grad,
        deferred=deferred,
        names=spec.names,
    )


def early_plan(
    spec: WeightGroupSpec,
    shape: tuple[int, ...],
    params: Sequence[Tensor],
    dtype: torch.dtype,
    device: torch.device,
    deferred: bool = False,
) -> WeightGradPlan | None:
    """The group's plan made now, where making it allocates nothing; else ``None``.

    An op with several wgrad GEMMs (the fused MLP) plans every ``main_grad``
    group before its first GEMM writes, so a malformed ``main_grad`` of any
    layer is rejected before any ``main_grad`` is written. Other routes
    allocate their buffers when planned and are planned at their turn, so
    peak memory stays as it was.
    """
    if not any(param.requires_grad for param in params):
        return None
    route = wgrad_route(params, wgrad_into_main_grad=spec.wgrad_into_main_grad, names=spec.names)
    if route is not WgradRoute.MAIN_GRAD:
        return None
    return _plan(spec, shape, params, dtype, device, deferred)


@dataclass(frozen=True)
class DeferredWgrad:
    """One group's wgrad GEMM, queued by backward for ``backward_dw()``.

    ``operands`` names the tensors the GEMM reads (``dy_TN`` and ``x_TK``)
    for messages; their version counters are recorded when the job is queued
    and checked when it runs.
    """

    spec: WeightGroupSpec
    shape: tuple[int, ...]
    params: tuple[Tensor, ...]
    dy_TN: Tensor
    x_TK: Tensor
    splits: Splits
    operands: tuple[str, str] = ("dy", "x")
    versions: tuple[int, int] = field(default=(0, 0))

    @classmethod
    def queue(
        cls,
        spec: WeightGroupSpec,
        shape: tuple[int, ...],
        params: Sequence[Tensor],
        dy_TN: Tensor,
        x_TK: Tensor,
        splits: Splits,
        operands: tuple[str, str],
    ) -> DeferredWgrad:
        """A job whose operands' versions are those they have now."""
        versions = (dy_TN._version, x_TK._version)
        return cls(spec, shape, tuple(params), dy_TN, x_TK, splits, operands, versions)

    def check_unchanged(self, owner: str) -> None:
        """Raise if ``dy_TN`` or ``x_TK`` was modified in place since the job was queued."""
        for name, tensor, version in zip(
            self.operands, (self.dy_TN, self.x_TK), self.versions, strict=True
        ):
            if tensor._version != version:
                raise RuntimeError(
                    f"{owner}.backward_dw(): {name}, which the deferred weight gradient of "
                    f"{self.spec.names[0]!r} reads, was modified in place since backward (its "
                    f"version is {tensor._version}, expected {version}); the gradient would not "
                    "match the values the forward saw. Do not modify it before backward_dw(), or "
                    "pass a copy"
                )

    def early_plan(self) -> WeightGradPlan | None:
        """:func:`early_plan` for this job."""
        return early_plan(
            self.spec, self.shape, self.params, self.dy_TN.dtype, self.dy_TN.device, True
        )

    def run(self, plan: WeightGradPlan | None = None) -> None:
        """Run the GEMM now, finalize distributed weights and deliver to ``.grad``."""
        run_wgrad(
            self.spec,
            self.shape,
            self.params,
            self.dy_TN,
            self.x_TK,
            self.splits,
            deferred=True,
            plan=plan,
        )


def wgrad_step(
    spec: WeightGroupSpec,
    shape: tuple[int, ...],
    params: Sequence[Tensor],
    dy_TN: Tensor,
    x_TK: Tensor,
    splits: Splits,
    deferred: list[DeferredWgrad] | None,
    operands: tuple[str, str] = ("dy", "x"),
    plan: WeightGradPlan | None = None,
) -> list[Tensor | None]:
    """Backward's wgrad step for one group: what autograd receives for its parameters.

    Trainability is read from the parameters: a group none of whose
    parameters requires grad runs nothing, and a frozen member of a group is
    never written (the plan gives it ``None``). With ``deferred`` (a list),
    the GEMM is appended there for ``backward_dw()`` (``operands`` names
    ``dy_TN`` and ``x_TK`` if it finds them changed) and autograd receives
    :func:`~groupgrad.protocol.defer_weight_grads`; otherwise it runs now
    (into ``plan`` when :func:`early_plan` made one).
    """
    if not any(param.requires_grad for param in params):
        return [None] * len(params)
    if deferred is None:
        return run_wgrad(spec, shape, params, dy_TN, x_TK, splits, plan=plan)
    deferred.append(DeferredWgrad.queue(spec, shape, params, dy_TN, x_TK, splits, operands))
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

        Every operand of the job is checked first: when one was changed in
        place since backward, the job is dropped (its gradient can no longer be
        computed from the values the forward saw) and nothing is written.
        Every ``main_grad`` group of the job is then planned (checked) before
        the first GEMM writes.

        Raises:
            RuntimeError: No backward has queued anything, or an operand of
                the oldest job was modified in place since its backward.
        """
        if not self._jobs:
            raise RuntimeError(
                f"{owner}.backward_dw() was called but no backward has queued a weight "
                "gradient; call it once after each backward"
            )
        job = self._jobs.popleft()
        for entry in job:
            entry.check_unchanged(owner)
        with no_autocast(job[0].dy_TN.device):
            plans = [entry.early_plan() for entry in job]
            for entry, plan in zip(job, plans, strict=True):
                entry.run(plan)
