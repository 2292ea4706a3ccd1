"""A GEMM operand as backward keeps it: a tensor, or its FP8 form (:class:`Fp8Blocks`).

Legend: ``T`` tokens, ``C`` channels (``K`` for ``x``, ``N`` for ``dy``).

The wgrad GEMM reads ``dy_TN`` and ``x_TK`` as bf16/fp16/fp32 tensors, or
with ``fp8_recipe="blockwise"`` as their ``(128, 1)`` :class:`Fp8Blocks`.
The wgrad machinery (``_wgrad``, ``_grads``, ``_compiled``) asks the helpers
here for what it needs of either (dtype, device, rows, versions, copies), so
it never branches on the form itself. An :class:`Fp8Blocks` crosses an
autograd context or a custom op as its tensors (:func:`take_apart`) and is
rebuilt from them with its static :class:`Fp8Form` (:func:`put_together`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, cast

import torch
from torch import Tensor

from groupgrad.kernels import Fp8Blocks

__all__ = [
    "Fp8Form",
    "Operand",
    "copy_operand",
    "operand_device",
    "operand_dtype",
    "operand_rows",
    "operand_versions",
    "put_together",
    "take_apart",
]

Operand = Tensor | Fp8Blocks
"""A wgrad GEMM operand: a ``(T, C)`` tensor or its ``(128, 1)`` :class:`Fp8Blocks`."""


class Fp8Form(NamedTuple):
    """What rebuilds an :class:`Fp8Blocks` besides its tensors, the token count and ``splits``.

    A tuple of constants, so a compiled graph carries it in its layout key: no
    size (a dynamic-shape trace makes them symbols); the source's columns ``C``
    are read off the data when it is rebuilt.

    Attributes:
        block: The block shape: ``(1, 128)`` (data ``(T, C)``) or ``(128, 1)``
            (data ``(C, Tp)``), the activation forms.
        dtype: The name of the dtype it was quantized from (``"bfloat16"``).
        present: Which entries of :meth:`Fp8Blocks.tensors` are tensors (the
            others are ``None``).
    """

    block: tuple[int, int]
    dtype: str
    present: tuple[bool, ...]


def operand_dtype(operand: Operand) -> torch.dtype:
    """The compute dtype: the tensor's, or the dtype an FP8 form was quantized from."""
    return operand.dtype


def operand_device(operand: Operand) -> torch.device:
    """Where the operand lives."""
    return operand.data.device if isinstance(operand, Fp8Blocks) else operand.device


def operand_rows(operand: Operand) -> int:
    """``T``, the number of token rows of the source (a symbol while a graph is traced)."""
    return operand.shape[0]


def operand_versions(operand: Operand) -> tuple[int, ...]:
    """The version counters of the operand's tensors (for the deferred wgrad's check)."""
    if isinstance(operand, Fp8Blocks):
        return tuple(t._version for t in operand.tensors() if t is not None)
    return (operand._version,)


def copy_operand(operand: Operand) -> Operand:
    """A copy that owns its memory (a compiled graph reuses the buffers it came from)."""
    if isinstance(operand, Tensor):
        return operand.clone()
    tensors = [None if t is None else t.clone() for t in operand.tensors()]
    return Fp8Blocks.from_tensors(
        tensors,
        block=operand.block,
        dtype=operand.dtype,
        shape=operand.shape,
        splits=operand.splits,
        listed=operand.listed,
    )


def take_apart(operand: Operand) -> tuple[Fp8Form | None, list[Tensor]]:
    """The operand's static form (``None`` for a tensor) and its tensors, in order."""
    if isinstance(operand, Tensor):
        return None, [operand]
    parts = operand.tensors()
    form = Fp8Form(
        (int(operand.block[0]), int(operand.block[1])),
        str(operand.dtype).removeprefix("torch."),
        tuple(t is not None for t in parts),
    )
    return form, [t for t in parts if t is not None]


def put_together(
    form: Fp8Form | None, tensors: Iterator[Tensor], tokens: int, splits: object
) -> Operand:
    """The operand :func:`take_apart` gave ``form`` and (the first of) ``tensors`` for.

    Args:
        form: The static form, or ``None`` for a plain tensor.
        tensors: Consumed: one tensor for a plain operand, else one per
            ``form.present`` entry that is ``True``.
        tokens: ``T``, the source's rows.
        splits: The ``splits`` the form was quantized with (the ``(128, 1)``
            block's own; pass the GEMM's, the same counts).
    """
    if form is None:
        return next(tensors)
    parts: Sequence[Tensor | None] = [next(tensors) if p else None for p in form.present]
    data = cast(Tensor, parts[0])
    tokens_blocked = form.block == (128, 1)
    return Fp8Blocks.from_tensors(
        parts,
        block=form.block,
        dtype=getattr(torch, form.dtype),
        shape=(tokens, data.shape[0] if tokens_blocked else data.shape[1]),
        splits=splits if tokens_blocked else None,
    )
