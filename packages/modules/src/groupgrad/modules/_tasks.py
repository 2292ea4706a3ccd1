"""Which backward a layer's gradients belong to: its autograd graph task, or the one it is nested in.

The wgrad rules that follow one backward — one ``backward_dw()`` job per
backward (``_wgrad_queue.WgradQueue.push``), the first GEMM into ``main_grad``
overwriting and the others adding (``_param_records.overwrites_of``) —
tell backwards apart by autograd's graph task id. A reentrant checkpoint
(``torch.utils.checkpoint`` with ``use_reentrant=True``, Megatron-Core's
recompute) runs the backward of each checkpointed region as a graph task of
its own, nested in the backward that recomputed the region's forward: a layer
used in two such regions would count as used in two backwards. So a grouped
Function's forward records the graph task running it (:func:`forward_task`:
the recomputing backward's, else none), its backward names that task as the
one it is nested in (:func:`enter_backward`), and the rules compare the tasks
they recorded with :func:`same_backward`.
"""

from __future__ import annotations

import torch

__all__ = [
    "backward_of",
    "enter_backward",
    "forward_task",
    "record_overwrites",
    "running_task",
    "same_backward",
]

#: A nested backward's graph task -> the graph task it runs in (insertion order: oldest first).
_OUTER_TASK: dict[int, int] = {}
_KEPT = 4096  # graph task ids only grow: the oldest entries belong to backwards long over

#: Per backward (as known when its GEMMs ran), the parameters whose ``main_grad`` a GEMM of it
#: overwrote (``overwrite_main_grad``), by id, with their names: a nesting learned after a
#: nested region's GEMM overwrote a parameter that its outer backward had overwritten already
#: joins two overwrites of one backward (:func:`enter_backward` raises).
_OVERWRITTEN: dict[int, dict[int, str]] = {}
_KEPT_OVERWRITTEN = 64  # a backward's nested tasks join it as its regions' layers run


def forward_task() -> int:
    """The graph task running a grouped Function's forward: a backward's when a checkpoint
    recomputes the forward inside it, else ``-1`` (also while compiling)."""
    if torch.compiler.is_compiling():
        return -1
    return torch._C._current_graph_task_id()


def enter_backward(outer: int) -> None:
    """Called first by a grouped Function's backward with its forward's :func:`forward_task`:
    when this backward runs as a graph task other than the one that ran the forward (a
    reentrant checkpoint's), it belongs to that one."""
    if outer < 0 or torch.compiler.is_compiling():
        return
    task = torch._C._current_graph_task_id()
    if task < 0 or task == outer or _OUTER_TASK.get(task) == outer:
        return
    mine = _OVERWRITTEN.pop(backward_of(task), None)  # what it overwrote as a backward of its own
    _OUTER_TASK[task] = outer
    while len(_OUTER_TASK) > _KEPT:
        del _OUTER_TASK[next(iter(_OUTER_TASK))]
    if mine:
        theirs = _freshest(backward_of(outer))
        twice = [name for key, name in mine.items() if key in theirs]
        theirs.update(mine)
        if twice:
            raise RuntimeError(
                f"main_grad of {', '.join(twice)} was overwritten twice in one backward "
                "(overwrite_main_grad): a reentrant checkpoint region nested in another ran "
                "its weight-gradient GEMM before the enclosing region's groupgrad layer (whose "
                "backward runs after the nested region's) told which backward it belongs to, "
                "so it overwrote this backward's earlier gradient; this step's main_grad is "
                "wrong. Use use_reentrant=False for the nested region, or "
                "delay_wgrad_compute=True (backward_dw() runs once the nesting is known)"
            )


def record_overwrites(task: int, params: dict[int, str]) -> None:
    """Record that a GEMM of graph task ``task``, planned now, overwrites the ``main_grad`` of
    ``params`` (id -> name), for :func:`enter_backward`'s check."""
    _freshest(backward_of(task)).update(params)


def _freshest(backward: int) -> dict[int, str]:
    """``backward``'s entry of :data:`_OVERWRITTEN`, made the newest (the oldest go first)."""
    entry = _OVERWRITTEN.pop(backward, {})
    _OVERWRITTEN[backward] = entry
    while len(_OVERWRITTEN) > _KEPT_OVERWRITTEN:
        del _OVERWRITTEN[next(iter(_OVERWRITTEN))]
    return entry


def running_task() -> int:
    """The graph task running now (``-1`` outside a backward), as recorded by the wgrad rules:
    compared later with :func:`same_backward`, once more nestings may be known."""
    return torch._C._current_graph_task_id()


def same_backward(first: int, second: int) -> bool:
    """Whether two graph tasks (:func:`running_task`) belong to one backward: the same
    outermost task of the chains reentrant checkpoints nested them in. Resolved when asked,
    so a nesting learned after the first was recorded still counts (a region's backward can
    run a nested region's GEMMs before a layer of its own tells whose backward it is)."""
    return first >= 0 and second >= 0 and backward_of(first) == backward_of(second)


def backward_of(task: int) -> int:
    """The backward a graph task belongs to (the outermost task of its chain, as now known);
    ``-1`` for none: two tasks are of one backward when this gives both the same task."""
    if task < 0:
        return -1
    while task in _OUTER_TASK:
        task = _OUTER_TASK[task]
    return task
