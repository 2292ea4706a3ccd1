"""How a group of per-expert matrices travels through the custom ops.

A group of ``E`` matrices of shape ``(N, K)`` is handed to a custom op as a
``list[Tensor]`` in one of two forms:

* packed, ``[w_ENK]`` — one ``(E, N, K)`` tensor (a one-element list), or
* listed, ``[w_NK, w_NK, …]`` — ``E`` separate ``(N, K)`` tensors.

Passing a packed tensor whole (rather than its ``E`` views) keeps the mutated
arguments of an op from aliasing each other, which functionalization and
``torch.library.opcheck`` require, and lets the CUTLASS kernels address the
matrices by stride with no per-expert host work. :func:`per_expert` turns
either form into the ``E`` per-expert matrices that the reference consumes.

Legend: ``E`` experts, ``N`` out_features, ``K`` in_features.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def op_form(group: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """A validated group as an op argument: ``[w_ENK]`` for a tensor, else the list of matrices."""
    if isinstance(group, Tensor):
        return [group]
    return list(group)


def is_packed(group: Sequence[Tensor]) -> bool:
    """Whether a group in op form is one packed ``(E, N, K)`` tensor (``[w_ENK]``)."""
    return len(group) == 1 and group[0].dim() == 3


def group_size(group: Sequence[Tensor]) -> int:
    """``E``, the number of matrices in a group in op form, packed or listed."""
    if is_packed(group):
        return group[0].size(0)
    return len(group)


def per_expert(group: Sequence[Tensor]) -> list[Tensor]:
    """The ``E`` per-expert ``(N, K)`` matrices of a group in op form (views of a packed one)."""
    if is_packed(group):
        return list(group[0].unbind(0))
    return list(group)
