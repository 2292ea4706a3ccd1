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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from groupgrad.protocol._attrs import (
    MAIN_GRAD_DTYPES,
    drop_dummy_grads,
    dummy_wgrad,
    fetch_main_grad,
    grad_dtype_of,
    main_grad_or_none,
    mark_grad_added,
    overwrites_main_grad,
    rezeroes_dummy,
    takes_grad_added_flag,
)
from groupgrad.protocol._buffers import member_grad_buffers, packed_grad_buffer
from groupgrad.protocol._distributed import (
    WeightGroup,
    as_weight_list,
    finalize_members,
    members_grad_dtype,
)
from groupgrad.protocol._hooks import hold_post_accumulate_grad_hooks
from groupgrad.protocol._route import (
    WgradRoute,
    autograd_dtype,
    check_shape,
    member_labels,
    route_of,
    uniform_plain_facts,
)

__all__ = [
    "WeightGradPlan",
    "autograd_dummies",
    "defer_weight_grads",
    "plan_weight_grads",
    "receives_dummy",
]


@dataclass
class WeightGradPlan:
    """The resolved answer to "where does this group's wgrad go", for one GEMM.

    Attributes:
        route: Where the gradient goes.
        weights: The group's parameters, leader first.
        buffers: Where the wgrad GEMM writes, one tensor per parameter, each of
            the GEMM's per-member shape (a packed ``(E, N, K)`` parameter has
            one ``(E, N, K)`` buffer). A member that does not require grad
            gets scratch that nothing reads.
        dtype: The buffers' dtype: the GEMM's output dtype.
        accumulate: The GEMM's accumulate flag: ``True`` adds into the buffers
            (beta = 1, only when adding into ``main_grad``), ``False``
            overwrites them without reading (beta = 0).
        deferred: The plan runs in ``backward_dw()``; what autograd receives at
            backward was already handed out by :func:`defer_weight_grads`.
        trainable: Per parameter, whether it requires grad (read when the
            plan was made). A frozen member is never written and receives
            ``None``.
        packed: The one ``(len(weights), *shape)`` tensor whose ``unbind(0)``
            views are :attr:`buffers`, when they are such views (a plain
            group's fresh buffers); ``None`` otherwise.
        names: How error messages name each parameter (``weights[i]`` by
            default); :attr:`gemm_names` derives the buffers' names.
    """

    route: WgradRoute
    weights: list[torch.Tensor]
    buffers: list[torch.Tensor]
    dtype: torch.dtype
    accumulate: bool
    deferred: bool = False
    trainable: tuple[bool, ...] = ()
    packed: torch.Tensor | None = None
    names: tuple[str, ...] = ()
    _finished: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not self.trainable:
            self.trainable = tuple(bool(p.requires_grad) for p in self.weights)
        if not self.names:
            self.names = member_labels(len(self.weights), None)

    def finish(self) -> list[torch.Tensor | None]:
        """Complete the plan once the GEMM has written :attr:`buffers`; call exactly once.

        Returns:
            One entry per parameter: what autograd receives (or, when
            deferred, what :func:`accumulate_grads_like_autograd` adds);
            ``None`` for every member that does not require grad.

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
        answers: list[torch.Tensor | None]
        if self.route is WgradRoute.AUTOGRAD:
            answers = list(self.buffers)
            drop_dummy_grads(
                p for p, keep in zip(self.weights, self.trainable, strict=True) if keep
            )
        elif self.route is WgradRoute.DISTRIBUTED:
            answers = finalize_members(self.weights, self.buffers)
        elif self.deferred:
            return [None] * len(self.weights)
        else:
            return _hand_over_main_grad(self.weights)
        if False not in self.trainable:
            return answers
        return [a if keep else None for a, keep in zip(answers, self.trainable, strict=True)]

    @property
    def gemm_out(self) -> torch.Tensor | list[torch.Tensor]:
        """:attr:`buffers` in the form a grouped-wgrad kernel's ``out`` takes.

        A packed ``(E, N, K)`` weight's single buffer is given as it is (the
        GEMM checks its shape); buffers that are views of one packed tensor
        give that tensor (the GEMM's packed path, no per-member work on the
        host); otherwise the list of the experts' buffers, also for a group of
        one expert (its one buffer is not an ``(E, N, K)`` tensor).
        """
        if len(self.weights) == 1 and self.weights[0].ndim == 3:
            return self.buffers[0]
        return self.packed if self.packed is not None else list(self.buffers)

    @property
    def gemm_names(self) -> list[str]:
        """How a wgrad kernel's messages name :attr:`gemm_out` (its ``names`` argument).

        A name per buffer, after its parameter, where :attr:`gemm_out` is a
        list or a single buffer: ``weight3.main_grad`` on the ``MAIN_GRAD``
        route (``weight3 (frozen: scratch)`` for a frozen member's scratch),
        ``weight3.grad_buffer()`` on the ``DISTRIBUTED`` route,
        ``weight3 wgrad`` for autograd's fresh buffers. The one packed tensor
        of a plain group gets one name (``weight0…weight127 wgrad``), so the
        packed path does no per-member work on the host.
        """
        suffix = {
            WgradRoute.MAIN_GRAD: ".main_grad",
            WgradRoute.DISTRIBUTED: ".grad_buffer()",
            WgradRoute.AUTOGRAD: " wgrad",
        }[self.route]
        if self.packed is not None and len(self.buffers) > 1:
            return [f"{self.names[0]}…{self.names[-1]}{suffix}"]
        return [
            f"{name}{suffix}"
            if keep or self.route is not WgradRoute.MAIN_GRAD
            else f"{name} (frozen: scratch)"
            for name, keep in zip(self.names, self.trainable, strict=True)
        ]


def _gets_dummy(param: torch.Tensor) -> bool:
    """On the ``MAIN_GRAD`` route: whether autograd receives a dummy for ``param``."""
    return bool(param.requires_grad) and takes_grad_added_flag(param)


def receives_dummy(
    weights: WeightGroup, *, wgrad_into_main_grad: bool, names: Sequence[str] | None = None
) -> list[bool]:
    """Per parameter: whether autograd receives a zero dummy for it at backward.

    True exactly for the trainable members that carry
    ``grad_added_to_main_grad`` in a group on the ``MAIN_GRAD`` route (what
    :meth:`WeightGradPlan.finish` and :func:`defer_weight_grads` hand out
    there); reads attributes only, so a tracer can follow it.
    """
    members = as_weight_list(weights)
    route = route_of(members, member_labels(len(members), names), wgrad_into_main_grad)
    return [route is WgradRoute.MAIN_GRAD and _gets_dummy(param) for param in members]


def _hand_over_main_grad(weights: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Flag and dummy for every trainable member that carries the flag; ``None`` elsewhere."""
    for param in weights:
        if _gets_dummy(param):
            mark_grad_added(param)
    return autograd_dummies(weights)


def autograd_dummies(weights: WeightGroup) -> list[torch.Tensor | None]:
    """What autograd receives for each member whose wgrad went to ``main_grad``.

    A zero dummy (:func:`~groupgrad.protocol.dummy_wgrad`) for every trainable
    member that carries ``grad_added_to_main_grad``, ``None`` elsewhere. Members
    of one shape and grad dtype share one cached buffer: it is fetched (and
    re-zeroed where needed) once and each member gets its own ``.detach()``
    alias. Sets no flag. A trainable member's ``.grad`` that is an alias of a dummy is
    dropped first (``_attrs.drop_dummy_grads``).
    """
    members = as_weight_list(weights)
    drop_dummy_grads(p for p in members if p.requires_grad)
    handed: list[torch.Tensor | None] = []
    dummy: torch.Tensor | None = None
    kind = None  # what picks the dummy's cached buffer, besides the device
    for param in members:
        if not _gets_dummy(param):
            handed.append(None)
            continue
        wanted = (param.shape, grad_dtype_of(param), rezeroes_dummy(param))
        if dummy is None or wanted != kind:
            dummy, kind = dummy_wgrad(param), wanted
            handed.append(dummy)
        else:
            handed.append(dummy.detach())
    return handed


def _main_grad_plan(
    members: list[torch.Tensor],
    shape: tuple[int, ...],
    device: torch.device,
    labels: tuple[str, ...],
    deferred: bool,
    known: Mapping[int, torch.Tensor],
) -> WeightGradPlan:
    check_shape(members, shape, labels)
    trainable = [bool(param.requires_grad) for param in members]
    live = [i for i, keep in enumerate(trainable) if keep]
    if not live:
        raise RuntimeError(
            f"no parameter of the group led by {labels[0]!r} requires grad; there is no weight "
            "gradient to write"
        )
    fetched = {i: known[i] if i in known else fetch_main_grad(members[i], labels[i]) for i in live}
    first = fetched[live[0]]
    if first.dtype not in MAIN_GRAD_DTYPES:
        raise RuntimeError(
            f"main_grad of {labels[live[0]]!r} has dtype {first.dtype}, expected one of "
            f"{', '.join(str(d) for d in MAIN_GRAD_DTYPES)}"
        )
    overwrite = [overwrites_main_grad(members[i]) for i in live]
    if any(overwrite) and not all(overwrite):
        split = ", ".join(f"{labels[i]}={flag}" for i, flag in zip(live, overwrite, strict=True))
        raise RuntimeError(
            f"overwrite_main_grad differs within one group ({split}); one wgrad GEMM either "
            "overwrites or accumulates, expected the same value on every parameter"
        )
    buffers = list(fetched.values())
    frozen = len(members) - len(live)
    if frozen:  # scratch that nothing reads, so the one GEMM still covers every expert
        scratch = iter(torch.empty((frozen, *shape), dtype=first.dtype, device=device).unbind(0))
        buffers = [fetched[i] if keep else next(scratch) for i, keep in enumerate(trainable)]
    return WeightGradPlan(
        route=WgradRoute.MAIN_GRAD,
        weights=members,
        buffers=buffers,
        dtype=first.dtype,
        accumulate=not overwrite[0],
        deferred=deferred,
        trainable=tuple(trainable),
        names=labels,
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
    fetched: Mapping[int, torch.Tensor] | None = None,
) -> WeightGradPlan:
    """Resolve where a group's wgrad GEMM writes, in which dtype, and whether it adds.

    Call this when the wgrad GEMM is about to run (in backward, or in
    ``backward_dw()`` when deferred): ``overwrite_main_grad`` is read now and
    ``get_main_grad()`` is called now, once per parameter (not for those in
    ``fetched``).

    * ``AUTOGRAD``: fresh buffers (one packed allocation, per-member views) in
      the parameters' ``grad_dtype`` (:func:`autograd_grad_dtype`: a bf16
      parameter whose ``grad_dtype`` is fp32 gets an fp32 GEMM output, never
      rounded to bf16); ``accumulate=False``.
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
        fetched: ``main_grad`` buffers an earlier plan of the same backward took,
            by member index: used as they are (``get_main_grad()`` is called
            once per backward, and may hand out a fresh buffer each call).

    Raises:
        RuntimeError: A parameter has no ``main_grad``, or one of a dtype not
            in :data:`MAIN_GRAD_DTYPES`; ``overwrite_main_grad`` differs
            within the group; a parameter has two gradient owners.
        ValueError: A plain parameter's shape differs from ``shape``.

    The buffers' shape, device, dtype, layout and overlap are checked once,
    by the GEMM that writes them: pass ``out=plan.gemm_out`` and
    ``names=plan.gemm_names`` to :func:`groupgrad.kernels.grouped_wgrad`
    (:func:`weight_grad_buffers` checks its buffers itself, for callers
    without a GEMM).
    """
    # the common autograd-route group in one pass: plain, trainable, one shape and grad dtype
    uniform = None if wgrad_into_main_grad else uniform_plain_facts(weights)
    members = list(cast(Sequence[torch.Tensor], weights)) if uniform else as_weight_list(weights)
    labels = member_labels(len(members), names)
    device = torch.device(device)
    shape = tuple(int(s) for s in shape)
    if uniform is None or uniform[1] != shape:
        route = route_of(members, labels, wgrad_into_main_grad)
        if route is WgradRoute.MAIN_GRAD:
            return _main_grad_plan(members, shape, device, labels, deferred, fetched or {})
        if route is WgradRoute.DISTRIBUTED:
            _check_scratch_dtype(members, compute_dtype, labels)
            buffers = member_grad_buffers(members, shape, compute_dtype, device)
            first = buffers[0]
            dtype = (
                first.dtype if isinstance(first, torch.Tensor) else compute_dtype
            )  # GEMM names it
            return WeightGradPlan(route, members, buffers, dtype, False, deferred, names=labels)
        check_shape(members, shape, labels)
    dtype = autograd_dtype(members) if uniform is None else uniform[0]
    packed = packed_grad_buffer(len(members), shape, dtype, device)
    return WeightGradPlan(
        WgradRoute.AUTOGRAD,
        members,
        list(packed.unbind(0)),
        dtype,
        False,
        deferred,
        trainable=() if uniform is None else (True,) * len(members),
        packed=packed,
        names=labels,
    )


def defer_weight_grads(
    weights: WeightGroup, *, wgrad_into_main_grad: bool, names: Sequence[str] | None = None
) -> list[torch.Tensor | None]:
    """Return what autograd receives at backward when the wgrad GEMM is deferred.

    ``MAIN_GRAD`` route: the flag and the dummy are handed out now (as
    :meth:`WeightGradPlan.finish` would), and ``main_grad`` is written later
    by the deferred GEMM. Other routes: ``None`` for every parameter; the
    deferred step delivers the gradient with
    :func:`accumulate_grads_like_autograd`. On every route the trainable
    members' post-accumulate-grad hooks are held back from autograd
    (:func:`hold_post_accumulate_grad_hooks`) until that step runs them, once,
    on the landed gradient.
    """
    members = as_weight_list(weights)
    route = route_of(members, member_labels(len(members), names), wgrad_into_main_grad)
    hold_post_accumulate_grad_hooks(p for p in members if p.requires_grad)
    if route is WgradRoute.MAIN_GRAD:
        return _hand_over_main_grad(members)
    drop_dummy_grads(p for p in members if p.requires_grad)  # before autograd adds into one
    return [None] * len(members)


def _check_scratch_dtype(
    members: Sequence[torch.Tensor], compute_dtype: torch.dtype, labels: Sequence[str]
) -> None:
    """A distributed group's plain followers get scratch typed by the leader's ``main_grad``
    (:func:`~groupgrad.protocol.weight_grad_dtype`); a trainable follower whose own
    ``main_grad`` has another dtype would have its wgrad rounded to the scratch's on the way
    to the reduce (a leader with no ``main_grad``, frozen say, types it ``compute_dtype``).

    Raises:
        RuntimeError: Naming the follower, both dtypes and the leader.
    """
    scratch = members_grad_dtype(list(members), compute_dtype)
    for label, member in zip(labels[1:], members[1:], strict=True):
        main_grad = main_grad_or_none(member)
        if (
            member.requires_grad
            and main_grad is not None
            and main_grad.dtype != scratch
            and not callable(getattr(member, "grad_buffer", None))
        ):
            raise RuntimeError(
                f"{label}.main_grad is {main_grad.dtype}, but the distributed group led by "
                f"{labels[0]} types its followers' wgrads {scratch} (the leader's main_grad "
                f"dtype, or the GEMM's {compute_dtype} where the leader has none): the reduce "
                f"would get {label}'s gradient rounded; give {labels[0]} a main_grad of "
                f"{main_grad.dtype} (a frozen leader's is never written)"
            )
