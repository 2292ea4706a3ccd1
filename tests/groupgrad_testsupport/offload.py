"""An activation offloader stand-in: what autograd saves inside a block, seen and copied out."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


@contextmanager
def offloaded_saved_tensors() -> Iterator[list[Tensor]]:
    """Inside the block, every tensor autograd saves is listed and replaced by a plain-tensor copy.

    The ``saved_tensors_hooks`` pair an offloader installs: ``pack`` records the
    saved tensor and hands back a detached clone stripped of any subclass (as
    a copy to host memory would be), ``unpack`` returns it. The yielded list
    holds the tensors as they were saved, in order, for the test to inspect
    (e.g. that no ``DistributedWeight`` is saved, which the copy would strip)::

        with offloaded_saved_tensors() as saved:
            y = module(x, splits)
        y.backward(dy)
    """
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t.detach().clone().as_subclass(torch.Tensor)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved
