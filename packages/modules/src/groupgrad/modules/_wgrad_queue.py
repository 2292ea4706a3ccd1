"""The FIFO of deferred wgrad GEMMs a layer with ``delay_wgrad_compute=True`` keeps.

Each backward pushes one job (:class:`~groupgrad.modules._wgrad.DeferredWgrad`
entries, one per weight group it deferred); each ``backward_dw()`` checks the
oldest job's operands, plans and checks every ``main_grad`` GEMM of it before
the first one writes, and runs it.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from typing import ClassVar

import torch

from groupgrad.modules._group import no_autocast
from groupgrad.modules._operands import operand_device
from groupgrad.modules._param_records import forget_fetched
from groupgrad.modules._tasks import running_task, same_backward
from groupgrad.modules._wgrad import DeferredWgrad, ReadyWgrad
from groupgrad.protocol import release_post_accumulate_grad_hooks

__all__ = ["WgradQueue"]


class WgradQueue:
    """FIFO of deferred wgrad GEMMs (``delay_wgrad_compute=True``), one job per backward.

    Each backward pushes one job (the wgrads of every weight group it
    deferred); each ``backward_dw()`` runs the oldest job. A layer used several
    times in one forward defers a GEMM for each use: the uses of one backward
    (one autograd graph task) make one job, whose parameters' post-accumulate-
    grad hooks run once, after the last of their GEMMs, on the whole gradient.
    """

    _registry: ClassVar[weakref.WeakValueDictionary[int, WgradQueue]] = (
        weakref.WeakValueDictionary()
    )
    _count: ClassVar[itertools.count[int]] = itertools.count()

    def __init__(self) -> None:
        self._jobs: collections.deque[list[DeferredWgrad]] = collections.deque()
        self._last_task = -1  # the autograd graph task that pushed the newest job
        # the newest backward through the layer deferred nothing (all its weights frozen, or
        # it asked for the input's gradient only), and no backward_dw() has answered it yet
        self._idle_backward = False
        self.number = next(WgradQueue._count)
        """This queue's registry number: how a compiled graph names it (a constant)."""
        WgradQueue._registry[self.number] = self

    @classmethod
    def numbered(cls, number: int) -> WgradQueue | None:
        """The live queue registered as ``number``; ``None`` for a negative number.

        Raises:
            RuntimeError: No live queue has that number (its module is gone).
        """
        if number < 0:
            return None
        queue = cls._registry.get(number)
        if queue is None:
            raise RuntimeError(
                f"the wgrad queue number {number} of a compiled graph no longer exists; the "
                "module it belonged to was deleted"
            )
        return queue

    def __len__(self) -> int:
        return len(self._jobs)

    def __reduce__(self) -> tuple[type[WgradQueue], tuple[()]]:
        """A copy or unpickled module gets a fresh, empty queue of its own number."""
        return (WgradQueue, ())

    def nothing_deferred(self) -> None:
        """A step's backward reaches the layer with nothing to defer, or not at all (see
        ``GroupedModule._after_forward``): the ``backward_dw()`` after it runs nothing."""
        self._idle_backward = True

    def push(self, job: list[DeferredWgrad]) -> None:
        """Queue the deferred wgrads of one backward: added to the newest job when the same
        backward (``_tasks.same_backward``) pushed it. An empty job queues nothing; the
        ``backward_dw()`` that follows it has nothing to run (and does not raise)."""
        self._idle_backward = not job
        if not job:
            return
        task = running_task()
        if self._jobs and same_backward(task, self._last_task):
            self._jobs[-1].extend(job)
            return
        self._jobs.append(job)
        self._last_task = task

    def pop_and_run(self, owner: str) -> None:
        """Run the oldest backward's deferred wgrads.

        Every operand of the job is checked first: when one was changed in
        place since backward, the job is dropped (its gradient can no longer be
        computed from the values the forward saw) and nothing is written.
        Every ``main_grad`` GEMM of the job is then planned and checked
        before the first GEMM writes: a refused one (a missing ``main_grad``)
        writes nothing and leaves the job first in line, its hooks held, to
        run once the caller mended what was refused.

        A GEMM or hook that raises while the job runs loses the job (its
        GEMMs not run yet are dropped, and every hold on the parameters' hooks
        goes back), as a failed backward loses its gradients.

        Raises:
            RuntimeError: No backward has queued anything (and the newest
                backward through the layer was not one that deferred
                nothing), or an operand of the oldest job was modified in
                place since its backward.
            ValueError, TypeError, RuntimeError: A ``main_grad`` check refused
                the job (it stays queued).
        """
        if not self._jobs and self._idle_backward:  # every weight frozen: nothing to run
            self._idle_backward = False
            return
        if not self._jobs:
            raise RuntimeError(
                f"{owner}.backward_dw() was called but no backward has queued a weight "
                "gradient; call it once after each backward"
            )
        job = self._jobs.popleft()
        # jobs one backward pushed before a reentrant region's nesting was known: one job
        while self._jobs and same_backward(job[0].task, self._jobs[0][0].task):
            job.extend(self._jobs.popleft())
        try:
            for entry in job:
                entry.check_unchanged(owner)
        except RuntimeError:
            _drop(job)
            raise
        # as in backward, where autograd's engine runs without grad: a main_grad that
        # requires grad is written alike by both (the kernels refuse that only with grad on)
        with no_autocast(operand_device(job[0].dy_TN)), torch.no_grad():
            try:
                self._run(job)
            finally:  # the main_grad buffers the job's plans took (a retry fetches them again)
                forget_fetched(job[0].task)

    def _run(self, job: list[DeferredWgrad]) -> None:
        """Plan and check every GEMM of ``job``, then run them (see :meth:`pop_and_run`)."""
        pending: set[int] = set()
        readied: list[ReadyWgrad | None] = []
        try:
            for entry in job:
                readied.append(entry.early(pending))
                pending.update(map(id, entry.target.params))
        except Exception:  # nothing written: the job waits for a retry
            self._jobs.appendleft(job)
            raise
        for index, (entry, ready) in enumerate(zip(job, readied, strict=True)):
            try:
                entry.run(ready)
            except BaseException:  # the job is lost (a hook or the GEMM raised)
                _drop(job[index + 1 :])
                raise


def _drop(entries: list[DeferredWgrad]) -> None:
    """Drop deferred GEMMs that will never run: off their parameters' queued ones, and
    their holds on the parameters' hooks go back (autograd runs them again)."""
    for entry in entries:
        entry.unqueue()
        release_post_accumulate_grad_hooks(entry.live())
