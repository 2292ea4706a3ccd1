"""The ops a block of eager code dispatches whose CUDA kernels add atomically: :func:`atomic_ops`.

CUDA's ``index_add_``, ``scatter_add_`` and their kind add in an order that
changes from run to run, so a sum taken by one differs in its last bits
between two runs of the same step. A :class:`~torch.utils._python_dispatch.
TorchDispatchMode` sees every aten op a block dispatches, on any device (so
the CPU suite catches one), down to the ops composite ones decompose into
(``index_select``'s backward is an ``index_add``); a custom op is one opaque
op. ``index_put_`` with ``accumulate=True`` sorts first on CUDA and is
deterministic; ``scatter_reduce`` and ``scatter`` count with their reduction
(``amax`` and ``amin`` are order-free, sums and products are not),
``bincount`` only with weights, ``cumsum`` only of floating-point values::

    assert atomic_ops(lambda: module(x, splits).sum().backward()) == set()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# from torch.use_deterministic_algorithms' lists (torch 2.13): the ops whose CUDA kernels sum
# (or multiply) atomically or in an order that changes from run to run, as named by
# OpRecorder (a reduction or its operands' kind in brackets where only some calls are)
ATOMIC_ON_CUDA = frozenset(
    {
        "aten::index_add",
        "aten::index_add_",
        "aten::index_reduce",
        "aten::index_reduce_",
        "aten::scatter_add",
        "aten::scatter_add_",
        "aten::scatter(add)",
        "aten::scatter_(add)",
        "aten::scatter(multiply)",
        "aten::scatter_(multiply)",
        "aten::scatter_reduce(sum)",
        "aten::scatter_reduce(prod)",
        "aten::scatter_reduce(mean)",
        "aten::scatter_reduce_(sum)",
        "aten::scatter_reduce_(prod)",
        "aten::scatter_reduce_(mean)",
        "aten::put",
        "aten::put_",
        "aten::bincount(weights)",
        "aten::cumsum(floating)",
        "aten::cumsum_(floating)",
        "aten::embedding_dense_backward",
        "aten::_embedding_bag_backward",
        "aten::_embedding_bag_dense_backward",
        "aten::histc",
    }
)


class OpRecorder(TorchDispatchMode):
    """Records the name of every aten op dispatched, with what makes some of its calls atomic.

    Attributes:
        names: ``"aten::index_add_"``, ``"aten::scatter_reduce(sum)"``, ...
    """

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self.names.add(_name(func._schema.name, args, kwargs))
        return func(*args, **kwargs)


def _name(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``name``, with the reduction or operand kind that makes some of its calls atomic."""
    if name.startswith("aten::scatter_reduce"):  # (self, dim, index, src, reduce)
        return f"{name}({kwargs.get('reduce', args[4] if len(args) > 4 else None)})"
    if name in ("aten::scatter", "aten::scatter_") and "reduce" in kwargs:  # keyword-only
        return f"{name}({kwargs['reduce']})"
    if (
        name == "aten::bincount"
        and kwargs.get("weights", args[1] if len(args) > 1 else None) is not None
    ):
        return f"{name}(weights)"
    if name in ("aten::cumsum", "aten::cumsum_") and args[0].is_floating_point():
        return f"{name}(floating)"
    return name


def atomic_ops(step: Callable[[], Any]) -> set[str]:
    """The ops of :data:`ATOMIC_ON_CUDA` that running ``step()`` dispatched."""
    recorder = OpRecorder()
    with recorder:
        step()
    return recorder.names & ATOMIC_ON_CUDA
