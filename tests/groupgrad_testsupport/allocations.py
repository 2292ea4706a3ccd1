"""What a block of eager code allocates: :class:`AllocationRecorder`, :func:`backward_allocations`.

::

    recorder = AllocationRecorder(numel=weight.numel())
    with recorder:
        y.backward(dy)
    assert recorder.big == [], recorder.big

    assert backward_allocations(module(x, splits), dy, numel=weight.numel()) == []
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationRecorder(TorchDispatchMode):
    """Records every op output that owns fresh storage of at least ``numel`` elements.

    The grouped kernels are custom ops, opaque to a dispatch mode: this sees
    what the module and the protocol allocate around them (a scratch wgrad
    buffer would be one). The GPU suite checks the kernels' own memory with
    CUDA memory statistics.

    Attributes:
        numel: The smallest allocation (in elements of the output's dtype) recorded.
        big: ``(op, shape)`` of each recorded output, in order.
    """

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.big: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in inputs:
                continue
            if storage.nbytes() // t.element_size() >= self.numel:
                self.big.append((str(func), tuple(t.shape)))
        return out


def backward_allocations(y: Tensor, dy: Tensor, numel: int) -> list[tuple[str, tuple[int, ...]]]:
    """Run ``y.backward(dy)`` under an :class:`AllocationRecorder`; return what it recorded."""
    recorder = AllocationRecorder(numel)
    with recorder:
        y.backward(dy)
    return recorder.big
