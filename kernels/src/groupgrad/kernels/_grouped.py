"""How a group of per-expert matrices travels through the custom ops.

A group of ``E`` matrices of shape ``(N, K)`` is handed to a custom op as a
``list[Tensor]`` in one of two forms:

* ``[w_ENK]`` — one packed ``(E, N, K)`` tensor (a one-element list), or
* ``[w_NK, w_NK, …]`` — ``E`` separate ``(N, K)`` tensors.

Passing a packed tensor whole (rather than its ``E`` views) keeps the mutated
arguments of an op from aliasing each other, which functionalization and
``torch.library.opcheck`` require. :func:`per_expert` turns either form into
the ``E`` per-expert matrices that kernels consume.

Legend: ``E`` experts, ``N`` out_features, ``K`` in_features.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def pack(group: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """The op-argument form of a validated group: ``[w_ENK]`` or a list of ``E`` matrices."""
    if isinstance(group, Tensor):
        return [group]
    return list(group)


def is_packed(group: Sequence[Tensor]) -> bool:
    """Whether a group in op-argument form is one packed ``(E, N, K)`` tensor (``[w_ENK]``)."""
    return len(group) == 1 and group[0].dim() == 3


def per_expert(packed: list[Tensor]) -> list[Tensor]:
    """The ``E`` per-expert ``(N, K)`` matrices of a group in op-argument form (views)."""
    if is_packed(packed):
        return list(packed[0].unbind(0))
    return list(packed)
