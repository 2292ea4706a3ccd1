"""Weight-gradient plans: every variant of "where does the wgrad go" resolved into data.

A layer's backward asks :func:`plan_weight_grads` for a :class:`WeightGradPlan`
right before its wgrad GEMM, writes the GEMM into ``plan.buffers`` with
``accumulate=plan.accumulate``, then calls :meth:`WeightGradPlan.finish` for
what autograd receives. The backward itself has no ``if`` ladder over
per-expert / packed / distributed / accumulate / overwrite; the plan holds the
answers.

When the wgrad is deferred (``delay_wgrad_compute``), backward hands autograd
:func:`defer_weight_grads` instead, and the later ``backward_dw()`` makes the
plan with ``deferred=True`` and passes :meth:`WeightGradPlan.finish`'s result
to :func:`accumulate_grads_like_autograd`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from groupgrad.protocol._attrs import (
    dummy_wgrad,
    fetch_main_grad,
    is_fsdp_param,
    mark_grad_added,
    overwrites_main_grad,
    rezeroes_dummy,
    takes_grad_added_flag,
)
from groupgrad.protocol._buffers import check_grad_buffers, weight_grad_buffers
from groupgrad.protocol._distributed import (
    WeightGroup,
    as_weight_list,
    finalize_weight_grads,
    is_distributed_weight,
)

__all__ = [
    "WeightGradPlan",
    "WgradRoute",
    "accumulate_grads_like_autograd",
    "defer_weight_grads",
    "plan_weight_grads",
    "run_post_accumulate_grad_hooks",
    "wgrad_route",
]

_MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class WgradRoute(enum.Enum):
    """Where a group's weight gradient goes."""

    AUTOGRAD = "autograd"
    """Returned to autograd in the parameter's dtype; autograd accumulates ``.grad``."""

    MAIN_GRAD = "main_grad"
    """Written by the GEMM straight into each parameter's ``main_grad``."""

    DISTRIBUTED = "distributed"
    """Written into ``weight_grad_buffers``; the leader's ``finalize_group_grads`` owns the rest."""


def _labels(count: int, names: Sequence[str] | None) -> list[str]:
    if names is None:
        return [f"weights[{i}]" for i in range(count)]
    if len(names) != count:
        raise ValueError(f"names has {len(names)} entries but the group has {count} weights")
    return list(names)


def wgrad_route(
    weights: WeightGroup, *, wgrad_into_main_grad: bool, names: Sequence[str] | None = None
) -> WgradRoute:
    """Decide where the group's weight gradient goes, without touching any buffer.

    A group whose leader is a ``DistributedWeight`` is distributed even when
    the layer writes into ``main_grad``.

    Args:
        weights: The group's parameters, leader first.
        wgrad_into_main_grad: Whether the layer was asked to write into
            ``main_grad`` (its ``accumulate_into_main_grad`` option).
        names: Parameter names for error messages.

    Raises:
        RuntimeError: A parameter is both a Megatron-FSDP parameter and a
            ``DistributedWeight``: two owners would reduce its gradient.
    """
    members = as_weight_list(weights)
    labels = _labels(len(members), names)
    for label, member in zip(labels, members, strict=True):
        if is_fsdp_param(member) and is_distributed_weight(member):
            raise RuntimeError(
                f"parameter {label!r} is both a Megatron-FSDP parameter (__fsdp_param__) and a "
                "DistributedWeight; a parameter can have only one owner of its gradient "
                "reduction"
            )
    if is_distributed_weight(members[0]):
        return WgradRoute.DISTRIBUTED
    return WgradRoute.MAIN_GRAD if wgrad_into_main_grad else WgradRoute.AUTOGRAD


@dataclass
class WeightGradPlan:
    """The resolved answer to "where does this group's wgrad go", for one GEMM.

    Attributes:
        route: Where the gradient goes.
        weights: The group's parameters, leader first.
        buffers: Where the wgrad GEMM writes, one tensor per parameter, each of
            the GEMM's per-member shape (a packed ``(E, N, K)`` parameter has
            one ``(E, N, K)`` buffer).
        dtype: The buffers' dtype: the GEMM's output dtype.
        accumulate: The GEMM's accumulate flag: ``True`` adds into the buffers
            (beta = 1, only when adding into ``main_grad``), ``False``
            overwrites them without reading (beta = 0).
        deferred: The plan runs in ``backward_dw()``; what autograd receives at
            backward was already handed out by :func:`defer_weight_grads`.
    """

    route: WgradRoute
    weights: list[torch.Tensor]
    buffers: list[torch.Tensor]
    dtype: torch.dtype
    accumulate: bool
    deferred: bool = False
    _finished: bool = field(default=False, repr=False)

    def finish(self) -> list[torch.Tensor | None]:
        """Complete the plan once the GEMM has written :attr:`buffers`; call exactly once.

        Returns:
            One entry per parameter: what autograd receives (or, when
            deferred, what :func:`accumulate_grads_like_autograd` adds).

            * ``AUTOGRAD``: the buffers themselves.
            * ``MAIN_GRAD``: sets ``grad_added_to_main_grad = True`` where that
              attribute exists and gives a zero dummy there, ``None``
              elsewhere; ``None`` everywhere when deferred (the flag and
              dummies were handed out at backward).
            * ``DISTRIBUTED``: the result of ``finalize_weight_grads``.

        Raises:
            RuntimeError: The plan was finished already.
        """
        if self._finished:
            raise RuntimeError(
                "WeightGradPlan.finish() was called twice; a wgrad lands exactly once"
            )
        self._finished = True
        if self.route is WgradRoute.AUTOGRAD:
            return list(self.buffers)
        if self.route is WgradRoute.DISTRIBUTED:
            return finalize_weight_grads(self.weights, self.buffers)
        if self.deferred:
            return [None] * len(self.weights)
        return _hand_over_main_grad(self.weights)

    @property
    def gemm_out(self) -> torch.Tensor | list[torch.Tensor]:
        """:attr:`buffers` in the form a grouped-wgrad kernel's ``out`` takes.

        A one-parameter group gives its single buffer (e.g. the ``(E, N, K)``
        ``main_grad`` of a packed weight); otherwise the list.
        """
        return self.buffers[0] if len(self.buffers) == 1 else list(self.buffers)


def _hand_over_main_grad(weights: list[torch.Tensor]) -> list[torch.Tensor | None]:
    handed: list[torch.Tensor | None] = []
    # Members of one group share shape, dtype and device, hence one cached dummy:
    # fetch (and re-zero) it once per group, then hand each member its own alias.
    dummy: torch.Tensor | None = None
    zeroed = False
    for param in weights:
        if not takes_grad_added_flag(param):
            handed.append(None)
            continue
        mark_grad_added(param)
        if dummy is None or dummy.shape != param.shape or dummy.dtype != param.dtype:
            dummy = dummy_wgrad(param)
            zeroed = rezeroes_dummy(param)
            handed.append(dummy)
            continue
        if not zeroed and rezeroes_dummy(param):
            dummy.zero_()
            zeroed = True
        handed.append(dummy.detach())
    return handed


def _check_shape(members: list[torch.Tensor], shape: tuple[int, ...], labels: list[str]) -> None:
    for label, param in zip(labels, members, strict=True):
        if tuple(param.shape) != shape:
            raise ValueError(
                f"parameter {label!r} has shape {tuple(param.shape)}, but the wgrad GEMM "
                f"produces {shape}"
            )


def _main_grad_plan(
    members: list[torch.Tensor],
    shape: tuple[int, ...],
    device: torch.device,
    labels: list[str],
    deferred: bool,
) -> WeightGradPlan:
    _check_shape(members, shape, labels)
    buffers = [fetch_main_grad(param, label) for param, label in zip(members, labels, strict=True)]
    check_grad_buffers(buffers, shape, device, what="main_grad", labels=labels)
    if buffers[0].dtype not in _MAIN_GRAD_DTYPES:
        raise RuntimeError(
            f"main_grad of {labels[0]!r} has dtype {buffers[0].dtype}, expected one of "
            f"{', '.join(str(d) for d in _MAIN_GRAD_DTYPES)}"
        )
    overwrite = [overwrites_main_grad(param) for param in members]
    if any(overwrite) and not all(overwrite):
        split = ", ".join(f"{label}={flag}" for label, flag in zip(labels, overwrite, strict=True))
        raise RuntimeError(
            f"overwrite_main_grad differs within one group ({split}); one wgrad GEMM either "
            "overwrites or accumulates, expected the same value on every parameter"
        )
    return WeightGradPlan(
        route=WgradRoute.MAIN_GRAD,
        weights=members,
        buffers=buffers,
        dtype=buffers[0].dtype,
        accumulate=not overwrite[0],
        deferred=deferred,
    )


def plan_weight_grads(
    weights: WeightGroup,
    *,
    shape: Sequence[int],
    compute_dtype: torch.dtype,
    device: torch.device | str,
    wgrad_into_main_grad: bool,
    deferred: bool = False,
    names: Sequence[str] | None = None,
) -> WeightGradPlan:
    """Resolve where a group's wgrad GEMM writes, in which dtype, and whether it adds.

    Call this when the wgrad GEMM is about to run (in backward, or in
    ``backward_dw()`` when deferred): ``overwrite_main_grad`` is read now and
    ``get_main_grad()`` is called now, once per parameter.

    * ``AUTOGRAD``: fresh buffers (one packed allocation, per-member views) in
      the parameter's dtype; ``accumulate=False``.
    * ``MAIN_GRAD``: each parameter's ``main_grad`` in its dtype;
      ``accumulate`` unless ``overwrite_main_grad``.
    * ``DISTRIBUTED``: :func:`weight_grad_buffers` (fp32 when the leader's
      ``main_grad`` is fp32); ``accumulate=False``.

    Args:
        weights: The group's parameters, leader first (the module's own
            parameters, not materialized copies).
        shape: The shape of one member's weight gradient as the GEMM
            produces it (the full weight's shape; e.g. ``(N, K)``, or
            ``(E, N, K)`` for a packed weight).
        compute_dtype: The GEMM's input dtype.
        device: Where the GEMM runs.
        wgrad_into_main_grad: Whether the layer writes into ``main_grad``.
        deferred: The GEMM runs in ``backward_dw()``; autograd already received
            :func:`defer_weight_grads`.
        names: Parameter names for error messages (default ``weights[i]``).

    Raises:
        RuntimeError: A parameter has no ``main_grad``; buffers have the wrong
            shape, device or dtype, or overlap; ``overwrite_main_grad`` differs
            within the group; a parameter has two gradient owners.
        ValueError: A plain parameter's shape differs from ``shape``.
    """
    members = as_weight_list(weights)
    labels = _labels(len(members), names)
    device = torch.device(device)
    shape = tuple(int(s) for s in shape)
    route = wgrad_route(members, wgrad_into_main_grad=wgrad_into_main_grad, names=labels)
    if route is WgradRoute.MAIN_GRAD:
        return _main_grad_plan(members, shape, device, labels, deferred)
    if route is WgradRoute.DISTRIBUTED:
        buffers = weight_grad_buffers(members, shape, compute_dtype, device)
        return WeightGradPlan(route, members, buffers, buffers[0].dtype, False, deferred)
    _check_shape(members, shape, labels)
    dtype = members[0].dtype
    buffers = weight_grad_buffers(members, shape, dtype, device)
    return WeightGradPlan(route, members, buffers, dtype, False, deferred)


def defer_weight_grads(
    weights: WeightGroup, *, wgrad_into_main_grad: bool, names: Sequence[str] | None = None
) -> list[torch.Tensor | None]:
    """Return what autograd receives at backward when the wgrad GEMM is deferred.

    ``MAIN_GRAD`` route: the flag and the dummy are handed out now (as
    :meth:`WeightGradPlan.finish` would), and ``main_grad`` is written later
    by the deferred GEMM. Other routes: ``None`` for every parameter; the
    deferred step delivers the gradient with
    :func:`accumulate_grads_like_autograd`.
    """
    members = as_weight_list(weights)
    route = wgrad_route(members, wgrad_into_main_grad=wgrad_into_main_grad, names=names)
    if route is WgradRoute.MAIN_GRAD:
        return _hand_over_main_grad(members)
    return [None] * len(members)


def accumulate_grads_like_autograd(
    weights: WeightGroup, grads: Sequence[torch.Tensor | None]
) -> None:
    """Add deferred gradients into ``.grad`` as autograd's AccumulateGrad would have.

    For each parameter that requires grad: a non-``None`` gradient goes into
    ``.grad`` (the gradient itself, detached, no copy, cast to the parameter's
    dtype, when ``.grad`` is ``None``; else added in place); then the
    parameter's post-accumulate-grad hooks run, as autograd runs them (it does
    so for a ``None`` gradient too). Call it with all-``None`` gradients to run
    the hooks once a deferred GEMM has written ``main_grad``.

    Args:
        weights: The group's parameters.
        grads: One entry per parameter, e.g. :meth:`WeightGradPlan.finish`'s result.

    Raises:
        ValueError: ``grads`` does not have one entry per parameter.
    """
    members = as_weight_list(weights)
    if len(grads) != len(members):
        raise ValueError(f"grads has {len(grads)} entries but the group has {len(members)} weights")
    with torch.no_grad():
        for param, grad in zip(members, grads, strict=True):
            if not param.requires_grad:
                continue
            if grad is not None:
                if param.grad is None:
                    param.grad = grad.detach().to(param.dtype).reshape(param.shape)
                else:
                    param.grad.add_(grad.reshape(param.shape))
            run_post_accumulate_grad_hooks(param)


def run_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """Run the hooks ``param.register_post_accumulate_grad_hook`` registered, in order."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    for hook in (hooks or {}).values():
        hook(param)
