"""Per parameter, what backwards did with its weight gradient (a weight may be in several groups).

Three rules follow one backward per parameter, not per weight group, since a
weight shared by two layers (or given to two functional calls) is in two
groups, each with a GEMM of its own:

* ``overwrite_main_grad``: the first GEMM of a backward into a parameter's
  ``main_grad`` overwrites it, the others add (:func:`overwrites_of`, after
  :func:`record_written` recorded the GEMMs that ran); a distributed weight's
  implementer delivers each GEMM's gradient itself, so a second one is refused
  (:func:`refuse_distributed_rewrite`);
* ``get_main_grad()``: called once per backward; that backward's later GEMMs
  into the parameter write the buffer the first plan took (:func:`fetched_for`,
  :func:`record_fetched`);
* ``delay_wgrad_compute``: a parameter's post-accumulate-grad hooks run after
  the last of one backward's deferred GEMMs into it, whichever module's
  ``backward_dw()`` runs that one (:func:`queue_deferred`,
  :func:`unqueue_deferred`), as autograd runs them once per backward.

Backwards are told apart by their graph tasks (``_tasks.backward_of``). The
records of the first and third rules are attributes of the parameter, so they live
as long as it does; not weak references, which make ``torch.utils.swap_tensors``
(``module.to()`` and ``load_state_dict`` with ``torch.__future__``'s swap on)
refuse the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import Tensor
from torch.autograd import Variable

from groupgrad.modules._tasks import backward_of, record_overwrites
from groupgrad.protocol import WeightGradPlan, is_fsdp_param, overwrites_main_grad

__all__ = [
    "fetched_for",
    "forget_fetched",
    "overwrites_of",
    "queue_deferred",
    "record_fetched",
    "record_written",
    "refuse_distributed_rewrite",
    "unqueue_deferred",
]

#: The attribute of a parameter whose ``main_grad`` a GEMM overwrote (``overwrite_main_grad``):
#: the backward (a graph task, compared by ``_tasks.backward_of``) whose gradient it holds. It
#: lives as long as its parameter (dropping the record of a backward still running would let
#: its next GEMM into that parameter overwrite the sum again).
_WRITTEN_FOR = "_groupgrad_main_grad_written_for"

#: This process's mark on the records kept as parameter attributes (``(mark, record)``):
#: ``torch.save`` of a module pickles them with their parameters, and graph task numbers
#: start again in another process, so a loaded record must not be taken for its own.
_PROCESS = object()


def _own(param: Tensor, attr: str) -> Any:
    """``param``'s record ``attr`` if this process wrote it, else ``None``."""
    value = getattr(param, attr, None)
    return value[1] if isinstance(value, tuple) and value[0] is _PROCESS else None


def overwrites_of(
    plan: WeightGradPlan, task: int, pending: AbstractSet[int]
) -> tuple[bool, tuple[Tensor, ...]]:
    """``(accumulate, zero_first)`` for a GEMM of backward ``task`` into ``main_grad``s
    that ``overwrite_main_grad`` says to overwrite: it overwrites where no earlier GEMM of
    that backward wrote (or is ``pending`` to write) any of its trainable parameters, adds
    where one wrote them all, and where one wrote some, adds after zeroing the others'.
    Records the parameters it overwrites or zeroes (``_tasks.record_overwrites``)."""
    members = zip(plan.weights, plan.buffers, plan.trainable, plan.names, strict=True)
    live = [(param, buffer, name) for param, buffer, keep, name in members if keep]
    mine = backward_of(task)
    written = [_written_for(param, mine, pending) for param, _, _ in live]
    first = {id(p): name for (p, _, name), done in zip(live, written, strict=True) if not done}
    record_overwrites(task, first)
    if not any(written):
        return False, ()
    return True, tuple(b for (_, b, _), done in zip(live, written, strict=True) if not done)


def refuse_distributed_rewrite(plan: WeightGradPlan, task: int, pending: AbstractSet[int]) -> None:
    """Refuse a second GEMM of backward ``task`` into a distributed weight whose
    ``overwrite_main_grad`` is set: its implementer's finalize delivers each GEMM's
    gradient itself, overwriting ``main_grad``, so it would keep the last use's only.

    Raises:
        RuntimeError: naming the parameter, before the GEMM runs.
    """
    mine = backward_of(task)
    for param, name, keep in zip(plan.weights, plan.names, plan.trainable, strict=True):
        if not keep or not overwrites_main_grad(param):
            continue
        if _written_for(param, mine, pending):
            raise RuntimeError(
                f"{name} is a distributed weight with overwrite_main_grad set and gets a second "
                "weight gradient in one backward (its layer is used more than once): its "
                "finalize overwrites main_grad with each, keeping the last use's only. For a "
                "weight used several times per backward, set overwrite_main_grad = False and "
                "zero main_grad between steps"
            )


def _written_for(param: Tensor, backward: int, pending: AbstractSet[int]) -> bool:
    """Whether a GEMM of ``backward`` (``_tasks.backward_of``) wrote ``param``'s ``main_grad``
    or is ``pending`` to write it."""
    task = _own(param, _WRITTEN_FOR)
    return id(param) in pending or (task is not None and backward_of(task) == backward)


def record_written(plan: WeightGradPlan, task: int) -> None:
    """Record that ``plan``'s trainable parameters' ``main_grad``s hold backward ``task``'s
    gradient (see :data:`_WRITTEN_FOR`)."""
    for param, keep in zip(plan.weights, plan.trainable, strict=True):
        if keep:
            setattr(param, _WRITTEN_FOR, (_PROCESS, task))


#: Per graph task that planned, per parameter (its id): the ``main_grad`` buffer a plan of
#: that task took, so the backward's later GEMMs into the parameter (in it or in a task of the
#: same backward: ``_tasks.backward_of``, resolved when asked) write the same buffer:
#: ``get_main_grad()`` is called once per backward (it may hand out a fresh buffer each call).
#: A backward's entries go when its outermost task ends (a callback queued on autograd's
#: engine; a reentrant checkpoint's nested task ends before the backward does), a deferred
#: job's when it has run (:func:`forget_fetched`), any left over (a backward that raised, or
#: one whose plans all ran in nested tasks) when another backward plans.
_FETCHED: dict[int, dict[int, Tensor]] = {}


def _tasks_of(task: int) -> list[int]:
    """The keys of :data:`_FETCHED` that belong to ``task``'s backward."""
    if not _FETCHED:
        return []
    mine = backward_of(task)
    return [key for key in _FETCHED if backward_of(key) == mine]


def fetched_for(params: Sequence[Tensor], task: int) -> dict[int, Tensor]:
    """The ``main_grad`` buffers earlier plans of backward ``task`` took, by index in ``params``."""
    taken: dict[int, Tensor] = {}
    for key in _tasks_of(task):
        taken.update(_FETCHED[key])
    return {i: taken[id(p)] for i, p in enumerate(params) if id(p) in taken}


def record_fetched(plan: WeightGradPlan, task: int) -> None:
    """Remember the ``main_grad`` buffers ``plan`` took from ``get_main_grad()`` (parameters
    marked ``__fsdp_param__``; a ``main_grad`` attribute is read at each plan) for backward
    ``task`` (see :data:`_FETCHED`); inside that backward, until it ends."""
    members = zip(plan.weights, plan.buffers, plan.trainable, strict=True)
    fetched = [(param, buffer) for param, buffer, keep in members if keep and is_fsdp_param(param)]
    if not fetched:
        return
    if task not in _FETCHED:
        mine = _tasks_of(task)  # backwards do not overlap, and one that raised ran no callback
        for key in [key for key in _FETCHED if key not in mine]:
            del _FETCHED[key]
        _FETCHED[task] = {}
        running = torch._C._current_graph_task_id()
        if running >= 0 and backward_of(running) == running:  # forget them as the backward ends
            Variable._execution_engine.queue_callback(lambda: forget_fetched(running))
    _FETCHED[task].update((id(param), buffer) for param, buffer in fetched)


def forget_fetched(task: int) -> None:
    """Drop what :func:`record_fetched` kept for ``task``'s backward (it ended, or its deferred
    job ran)."""
    for key in _tasks_of(task):
        del _FETCHED[key]


#: The attribute of a parameter listing the backwards (graph tasks) of its deferred GEMMs
#: queued and not yet run, in any module's queue (a weight shared by two layers is in both).
_QUEUED = "_groupgrad_deferred_tasks"


def queue_deferred(params: Iterable[Tensor], task: int) -> None:
    """Record a deferred GEMM of backward ``task`` into each of ``params``."""
    for param in params:
        tasks = _own(param, _QUEUED)
        if tasks is None:
            tasks = []
            setattr(param, _QUEUED, (_PROCESS, tasks))
        tasks.append(task)


def unqueue_deferred(params: Sequence[Tensor], trainable: Sequence[bool], task: int) -> list[bool]:
    """Take a deferred GEMM of backward ``task`` off the ``trainable`` ones of ``params`` (it
    ran, or its job was dropped): for each parameter, whether no other GEMM of that backward
    into it is queued (its hooks run after this one)."""
    mine = backward_of(task)
    last = []
    for param, keep in zip(params, trainable, strict=True):
        tasks = (_own(param, _QUEUED) or []) if keep else []
        if task in tasks:
            tasks.remove(task)
        last.append(all(backward_of(other) != mine for other in tasks))
    return last
