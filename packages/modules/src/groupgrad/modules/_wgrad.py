"""A layer's weight-gradient GEMM: planned by the protocol, run now or deferred.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.

:class:`WgradTarget` is what one layer's wgrad GEMM writes for: its weight
layout, the full wgrad shape and the parameters. Its :meth:`~WgradTarget.step`
is backward's wgrad step: it resolves the ``main_grad`` contract into a plan
(``groupgrad.protocol``) and runs the GEMM into it, or queues a
:class:`DeferredWgrad` for ``backward_dw()``. A deferred job checks, as
autograd checks saved tensors, that its operands were not changed in place
before it runs; the queue (``_wgrad_queue.WgradQueue``) plans and checks every ``main_grad``
GEMM of a job before the first one writes, so a rejected job writes nothing.
The buffers are checked once, by the kernels' validator
(:func:`~groupgrad.kernels.prepare_wgrad`), whose messages name them after
the parameters (``weight3.main_grad``).
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch
from torch import Tensor

from groupgrad.kernels import PreparedWgrad, prepare_wgrad
from groupgrad.modules._group import Splits, WeightGroupSpec
from groupgrad.modules._operands import (
    Operand,
    operand_device,
    operand_dtype,
    operand_versions,
)
from groupgrad.modules._param_records import (
    fetched_for,
    overwrites_of,
    queue_deferred,
    record_fetched,
    record_written,
    refuse_distributed_rewrite,
    unqueue_deferred,
)
from groupgrad.modules._tasks import running_task
from groupgrad.protocol import (
    WeightGradPlan,
    WgradRoute,
    accumulate_grads_like_autograd,
    defer_weight_grads,
    overwrites_main_grad,
    plan_weight_grads,
    release_post_accumulate_grad_hooks,
    wgrad_route,
)

__all__ = ["DeferredWgrad", "ReadyWgrad", "WgradTarget"]


@dataclass(frozen=True)
class ReadyWgrad:
    """A wgrad GEMM planned and checked, not yet run: its plan and its checked kernel call;
    with ``overwrite_main_grad``, the backward it writes for (``task``, recorded when it runs;
    ``-1``: none) and the ``main_grad``s to zero first (``_param_records.overwrites_of``)."""

    plan: WeightGradPlan
    gemm: PreparedWgrad
    task: int = -1
    zero_first: tuple[Tensor, ...] = ()

    def run(self) -> list[Tensor | None]:
        """Run the GEMM, record the backward it wrote for, and finish the plan."""
        for buffer in self.zero_first:
            buffer.zero_()
        self.gemm.run()
        if self.task >= 0:
            record_written(self.plan, self.task)
        return self.plan.finish()


@dataclass(frozen=True)
class WgradTarget:
    """What one layer's wgrad GEMM writes for.

    Attributes:
        spec: The layer's weight layout and ``main_grad`` option.
        shape: One parameter's full wgrad shape: the materialized weight's
            shape, ``(N, K)`` or packed ``(E, N, K)``.
        params: The layer's parameters (not materialized copies), leader first.
        frozen_at_forward: Per parameter, whether it did not require grad when the
            forward ran (``()``: not known, as in a compiled backward's op).
    """

    spec: WeightGroupSpec
    shape: tuple[int, ...]
    params: tuple[Tensor, ...]
    frozen_at_forward: tuple[bool, ...] = ()

    @property
    def num_groups(self) -> int:
        """``E``: the packed weight's first dimension, or the number of per-expert weights."""
        return self.shape[0] if self.spec.packed else len(self.params)

    def trainable(self) -> bool:
        """Whether any parameter requires grad (else there is no GEMM to run)."""
        return any(param.requires_grad for param in self.params)

    def refuse_thawed(self, deferred: bool) -> None:
        """Refuse a parameter that did not require grad when the forward ran and does now,
        where its gradient would go past autograd (``main_grad``, a distributed weight, or a
        ``deferred`` GEMM): autograd gives it none for this backward. On the immediate
        autograd route autograd drops it itself, as for any op.

        Raises:
            RuntimeError: Naming the parameter (before anything is written).
        """
        known = zip(self.frozen_at_forward, self.params, self.spec.names, strict=False)  # () too
        thawed = [name for frozen, param, name in known if frozen and param.requires_grad]
        if thawed and (deferred or self.route() is not WgradRoute.AUTOGRAD):
            raise RuntimeError(
                f"{thawed[0]!r} did not require grad when the forward ran but does now: "
                "autograd gives it no gradient for this backward, and its weight gradient GEMM "
                "would write one; change requires_grad before a forward, not between it and "
                "its backward (or backward_dw())"
            )

    def route(self) -> WgradRoute:
        """Where the wgrad goes (the protocol's :func:`~groupgrad.protocol.wgrad_route`)."""
        return wgrad_route(
            self.params, wgrad_into_main_grad=self.spec.wgrad_into_main_grad, names=self.spec.names
        )

    def plan(
        self, dtype: torch.dtype, device: torch.device, deferred: bool, task: int
    ) -> WeightGradPlan:
        """The protocol's plan for backward ``task``, made now (``overwrite_main_grad`` read
        now; ``get_main_grad()`` called now unless an earlier plan of that backward took the
        parameter's buffer: ``_param_records.fetched_for``).

        Raises:
            RuntimeError: :meth:`refuse_thawed`, for a ``deferred`` GEMM (a weight may thaw
                between backward and ``backward_dw()``; ``_grads.parameter_grads`` checked
                the backward's own before anything was written).
        """
        if deferred:
            self.refuse_thawed(True)
        plan = plan_weight_grads(
            self.params,
            shape=self.shape,
            compute_dtype=dtype,
            device=device,
            wgrad_into_main_grad=self.spec.wgrad_into_main_grad,
            deferred=deferred,
            names=self.spec.names,
            fetched=fetched_for(self.params, task) if task >= 0 else None,
        )
        if task >= 0 and plan.route is WgradRoute.MAIN_GRAD:
            record_fetched(plan, task)
        return plan

    def ready(
        self,
        dy_TN: Operand,
        x_TK: Operand,
        splits: Splits,
        plan: WeightGradPlan,
        task: int | None = None,
        pending: AbstractSet[int] = frozenset(),
    ) -> ReadyWgrad:
        """The GEMM into ``plan``'s buffers, checked by the kernels (names from the plan).

        Where ``overwrite_main_grad`` says overwrite, the first GEMM of a backward into
        a parameter overwrites its ``main_grad``, the others add (a layer used twice, a
        weight shared by two layers; ``_param_records.overwrites_of``). ``task``: the
        backward it writes for (``None``: the one running now; a deferred job's is the
        one that queued it); ``pending``: parameters whose GEMMs of that backward are
        planned, not yet run (``backward_dw()`` plans a job's GEMMs before the first runs).
        """
        task = running_task() if task is None else task
        zero_first: tuple[Tensor, ...] = ()
        overwrites = plan.route is WgradRoute.MAIN_GRAD and not plan.accumulate
        if overwrites and task >= 0:
            plan.accumulate, zero_first = overwrites_of(plan, task, pending)
        elif plan.route is WgradRoute.DISTRIBUTED and task >= 0:
            overwrites = any(map(overwrites_main_grad, plan.weights))
            if overwrites:
                refuse_distributed_rewrite(plan, task, pending)
        out, names = plan.gemm_out, plan.gemm_names
        gemm = prepare_wgrad(dy_TN, x_TK, splits, out=out, accumulate=plan.accumulate, names=names)
        return ReadyWgrad(plan, gemm, task if overwrites else -1, zero_first)

    def early(
        self,
        dy_TN: Operand,
        x_TK: Operand,
        splits: Splits,
        deferred: bool = False,
        task: int | None = None,
        pending: AbstractSet[int] = frozenset(),
    ) -> ReadyWgrad | None:
        """The GEMM planned and checked now where that allocates nothing (``main_grad``), else ``None``.

        An op with several wgrad GEMMs (the fused MLP) readies every
        ``main_grad`` GEMM before its first GEMM writes, so a malformed
        ``main_grad`` of any layer is rejected before any ``main_grad`` is
        written. Other routes allocate their buffers when planned and are
        planned at their turn, so peak memory stays as it was. ``task`` and
        ``pending``: as :meth:`ready` takes them.
        """
        if not self.trainable():
            return None
        if self.route() is not WgradRoute.MAIN_GRAD:
            return None
        task = running_task() if task is None else task
        plan = self.plan(operand_dtype(dy_TN), operand_device(dy_TN), deferred, task)
        return self.ready(dy_TN, x_TK, splits, plan, task, pending)

    def run(
        self,
        dy_TN: Operand,
        x_TK: Operand,
        splits: Splits,
        *,
        deferred: bool = False,
        ready: ReadyWgrad | None = None,
        run_hooks: bool | Sequence[bool] = True,
        task: int | None = None,
    ) -> list[Tensor | None]:
        """Run the GEMM ``dw_e = dy_e.T @ x_e`` into the plan's buffers and finish the plan.

        Args:
            dy_TN: ``(T, N)`` output gradient (or its ``(128, 1)`` FP8 form).
            x_TK: ``(T, K)`` input (or its ``(128, 1)`` FP8 form).
            splits: ``E`` token counts.
            deferred: Running in ``backward_dw()``: the result is delivered to
                ``.grad`` here (as autograd would) instead of being returned.
            ready: What :meth:`early` readied for this GEMM, or ``None``
                (planned and checked now, for backward ``task``: see :meth:`ready`).
            run_hooks: Deferred: run the parameters' post-accumulate-grad hooks
                after delivering (``False`` where a later GEMM of the same
                backward adds to them), for all or per parameter.

        Returns:
            What autograd receives for each parameter (all ``None`` when deferred).
        """
        if ready is None:
            task = running_task() if task is None else task
            plan = self.plan(operand_dtype(dy_TN), operand_device(dy_TN), deferred, task)
            ready = self.ready(dy_TN, x_TK, splits, plan, task)
        if not deferred:
            return ready.run()
        try:
            grads = ready.run()
        except BaseException:  # nothing to deliver: the holds backward put on the hooks go back
            release_post_accumulate_grad_hooks(p for p in self.params if p.requires_grad)
            raise
        accumulate_grads_like_autograd(self.params, grads, run_hooks=run_hooks)
        return [None] * len(self.params)

    def step(
        self,
        dy_TN: Operand,
        x_TK: Operand,
        splits: Splits,
        deferred: list[DeferredWgrad] | None,
        operands: tuple[str, str] = ("dy", "x"),
        ready: ReadyWgrad | None = None,
    ) -> list[Tensor | None]:
        """Backward's wgrad step: what autograd receives for the parameters.

        Trainability is read from the parameters: when none requires grad
        nothing runs, and a frozen member of a group is never written (the
        plan gives it ``None``). With ``deferred`` (a list), the GEMM is
        appended there for ``backward_dw()`` (``operands`` names ``dy_TN`` and
        ``x_TK`` if it finds them changed) and autograd receives
        :func:`~groupgrad.protocol.defer_weight_grads`; otherwise it runs now
        (as ``ready`` when :meth:`early` readied it).
        """
        if not self.trainable():
            return [None] * len(self.params)
        if deferred is None:
            return self.run(dy_TN, x_TK, splits, ready=ready)
        deferred.append(DeferredWgrad.queue(self, dy_TN, x_TK, splits, operands))
        return defer_weight_grads(
            self.params, wgrad_into_main_grad=self.spec.wgrad_into_main_grad, names=self.spec.names
        )


@dataclass(frozen=True)
class DeferredWgrad:
    """One layer's wgrad GEMM, queued by backward for ``backward_dw()``.

    ``operands`` names ``dy_TN`` and ``x_TK`` for messages; ``versions`` are
    their version counters when the job was queued, ``trainable`` which
    parameters required grad then: both checked when it runs.
    """

    target: WgradTarget
    dy_TN: Operand
    x_TK: Operand
    splits: Splits
    operands: tuple[str, str]
    versions: tuple[tuple[int, ...], tuple[int, ...]]
    trainable: tuple[bool, ...]
    task: int

    @classmethod
    def queue(
        cls,
        target: WgradTarget,
        dy_TN: Operand,
        x_TK: Operand,
        splits: Splits,
        operands: tuple[str, str],
    ) -> DeferredWgrad:
        """A job whose operands' versions are those they have now, for the backward
        running now (its graph task)."""
        versions = (operand_versions(dy_TN), operand_versions(x_TK))
        trainable = tuple(p.requires_grad for p in target.params)
        job = cls(target, dy_TN, x_TK, splits, operands, versions, trainable, running_task())
        queue_deferred(job.live(), job.task)
        return job

    def live(self) -> list[Tensor]:
        """The parameters that required grad when the job was queued (the ones it writes)."""
        return [p for p, keep in zip(self.target.params, self.trainable, strict=True) if keep]

    def unqueue(self) -> list[bool]:
        """Take this GEMM off its parameters' queued ones (it ran, or its job was dropped):
        for each parameter, whether it was the last of its backward's (hooks run after it)."""
        return unqueue_deferred(self.target.params, self.trainable, self.task)

    def check_unchanged(self, owner: str) -> None:
        """Raise if ``dy_TN`` or ``x_TK`` was modified in place since the job was queued, or
        a parameter was frozen or unfrozen since (backward already handed autograd what
        the parameters' trainability then called for: the flag and dummy, held hooks)."""
        trainable = tuple(p.requires_grad for p in self.target.params)
        if trainable != self.trainable:
            index = next(
                i for i, (a, b) in enumerate(zip(trainable, self.trainable, strict=True)) if a != b
            )
            raise RuntimeError(
                f"{owner}.backward_dw(): {self.target.spec.names[index]} has requires_grad="
                f"{trainable[index]} now but had {self.trainable[index]} at the backward that deferred "
                "its weight gradient (which handed autograd what that called for); freeze or "
                "unfreeze parameters after backward_dw(), not between backward and it"
            )
        for name, operand, version in zip(
            self.operands, (self.dy_TN, self.x_TK), self.versions, strict=True
        ):
            now = operand_versions(operand)
            if now != version:
                shown = now[0] if len(now) == 1 else now
                wanted = version[0] if len(version) == 1 else version
                raise RuntimeError(
                    f"{owner}.backward_dw(): {name}, which the deferred weight gradient of "
                    f"{self.target.spec.names[0]!r} reads, was modified in place since backward "
                    f"(its version is {shown}, expected {wanted}); the gradient would "
                    "not match the values the forward saw. Do not modify it before backward_dw(), "
                    "or pass a copy"
                )

    def early(self, pending: AbstractSet[int]) -> ReadyWgrad | None:
        """:meth:`WgradTarget.early` for this job, of the backward that queued it
        (``pending``: the parameters its job's GEMMs planned before this one write)."""
        return self.target.early(
            self.dy_TN, self.x_TK, self.splits, deferred=True, task=self.task, pending=pending
        )

    def run(self, ready: ReadyWgrad | None = None) -> None:
        """Run the GEMM now, finalize distributed weights and deliver to ``.grad``; a
        parameter's post-accumulate-grad hooks run after the last of one backward's deferred
        GEMMs into it, whichever module's ``backward_dw()`` runs that one (as autograd runs
        them once, after the last gradient of the backward)."""
        hooks, task = self.unqueue(), self.task
        self.target.run(
            self.dy_TN,
            self.x_TK,
            self.splits,
            deferred=True,
            ready=ready,
            run_hooks=hooks,
            task=task,
        )
