"""Which ops whose CUDA kernels add atomically a block of eager code dispatches: :func:`atomic_ops`.

CUDA's ``index_add_``, ``scatter_add_`` and their kind add in an order that
changes from run to run, so a sum taken by one differs in its last bits
between two runs of the same step. A :class:`~torch.utils._python_dispatch.
TorchDispatchMode` sees every aten op a block dispatches, on any device (so
the CPU suite catches one), down to the ops composite ones decompose into
(``index_select``'s backward is an ``index_add``); a custom op is one opaque
op. ``index_put_`` with ``accumulate=True`` sorts first on CUDA and is
deterministic; ``scatter_reduce`` counts with its reduction (``amax`` and
``amin`` are order-free, its sums and products are not)::

    assert atomic_ops(lambda: module(x, splits).sum().backward()) == set()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# torch.use_deterministic_algorithms' lists (torch 2.13) of what CUDA computes atomically
ATOMIC_ON_CUDA = frozenset(
    {
        "aten::index_add",
        "aten::index_add_",
        "aten::index_reduce",
        "aten::index_reduce_",
        "aten::scatter_add",
        "aten::scatter_add_",
        "aten::scatter_reduce(sum)",
        "aten::scatter_reduce(prod)",
        "aten::scatter_reduce(mean)",
        "aten::scatter_reduce_(sum)",
        "aten::scatter_reduce_(prod)",
        "aten::scatter_reduce_(mean)",
        "aten::put",
        "aten::put_",
        "aten::embedding_dense_backward",
        "aten::_embedding_bag_backward",
        "aten::_embedding_bag_dense_backward",
        "aten::histc",
    }
)


class OpRecorder(TorchDispatchMode):
    """Records the name of every aten op dispatched (``scatter_reduce`` with its reduction).

    Attributes:
        names: ``"aten::index_add_"``, ``"aten::scatter_reduce(sum)"``, ...
    """

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("aten::scatter_reduce"):  # (self, dim, index, src, reduce)
            name += f"({kwargs.get('reduce', args[4] if len(args) > 4 else None)})"
        self.names.add(name)
        return func(*args, **kwargs)


def atomic_ops(step: Callable[[], Any]) -> set[str]:
    """The ops of :data:`ATOMIC_ON_CUDA` that running ``step()`` dispatched."""
    recorder = OpRecorder()
    with recorder:
        step()
    return recorder.names & ATOMIC_ON_CUDA
