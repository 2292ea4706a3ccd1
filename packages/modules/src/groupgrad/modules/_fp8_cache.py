"""A layer's quantized weights kept across forwards (``is_first_microbatch``, TransformerEngine's way).

Legend: ``E`` experts, ``N`` out_features, ``K`` in_features.

With gradient accumulation the weights do not change between the
micro-batches of one optimizer step, so their FP8 form need not be computed
again: ``forward(..., is_first_microbatch=True)`` quantizes and caches,
``False`` reuses the cache. The caller's flag is the rule; the cache also
drops an entry whose parameters changed in a way it can see — another
parameter object, another ``data_ptr``, shape, strides or dtype, a moved version
counter (an in-place update such as ``torch.optim``'s ``p.add_(...)``
under ``no_grad``), or any ``torch.optim`` optimizer's step since (a fused
optimizer kernel, ``fused=True``, moves no version counter). A write
through ``.data`` (``p.data.copy_(new)``) or into the storage
(``p.untyped_storage().copy_(...)``) moves no version counter and keeps the
pointer: only the flag catches it.

The entry holds its parameters by strong reference, not by ``weakref``: a
weak reference makes ``torch.utils.swap_tensors`` (``module.to()`` and
``load_state_dict`` with ``torch.__future__``'s swap on) refuse the
parameter. A parameter replaced in the module stays alive until the next
``True`` (or ``clear``) replaces the entry. So does the memory each
parameter had when it was quantized (its storage): were it freed by a
``.data =`` assignment, the allocator could give that very address to the
next one (``p.data = a; p.data = b``), which moves no version counter, and
the stamps would match weights they were not taken from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from groupgrad.kernels import Fp8Blocks

__all__ = ["Fp8WeightCache", "optimizer_steps"]

_STEPS = [0, 0]  # torch.optim steps seen since the hook went in; whether it is in


def optimizer_steps() -> int:
    """How many ``torch.optim`` optimizer steps ran since the first cache entry (a global
    step post-hook, registered then, counts them)."""
    if not _STEPS[1]:
        _STEPS[1] = 1
        register_optimizer_step_post_hook(_count_step)
    return _STEPS[0]


def _count_step(optimizer: object, args: object, kwargs: object) -> None:
    _STEPS[0] += 1


_Stamp = tuple[int, int, torch.Size, tuple[int, ...]]


def _stamps(params: Sequence[Tensor]) -> list[_Stamp]:
    """What the cache compares of each parameter: its data pointer, version, shape and
    strides (``p.data = p.data.t()`` on a square weight keeps the other three) (one
    comprehension: at 128 experts a layer's stamps are taken twice a step)."""
    return [(p.data_ptr(), p._version, p.shape, p.stride()) for p in params]


@dataclass(frozen=True)
class _Entry:
    """One cached FP8 weight and what it was quantized from."""

    params: tuple[Tensor, ...]
    storages: tuple[torch.UntypedStorage, ...]  # held, never read: their addresses stay taken
    stamps: list[_Stamp]
    steps: int
    dtype: torch.dtype
    blocks: Fp8Blocks

    def serves(self, params: Sequence[Tensor], dtype: torch.dtype) -> bool:
        """Whether ``params``, quantized from ``dtype``, are still what this entry holds."""
        return (
            dtype == self.dtype
            and self.steps == _STEPS[0]
            and len(params) == len(self.params)
            and all(q is p for q, p in zip(self.params, params, strict=True))
            and _stamps(params) == self.stamps
        )


class Fp8WeightCache:
    """The quantized ``(128, 128)`` weights of one layer, kept while they still match.

    Plain Python state of the module, not a buffer: ``state_dict`` and
    checkpoints carry none of it, and a copied or unpickled module starts
    with an empty cache.
    """

    def __init__(self) -> None:
        self._entry: _Entry | None = None

    def __reduce__(self) -> tuple[type[Fp8WeightCache], tuple[()]]:
        """A copy or unpickled module gets an empty cache (no FP8 state travels)."""
        return (Fp8WeightCache, ())

    def __bool__(self) -> bool:
        """Whether an entry is held (valid or not)."""
        return self._entry is not None

    def get(self, params: Sequence[Tensor], dtype: torch.dtype) -> Fp8Blocks | None:
        """The cached weights of ``params`` quantized from ``dtype``, or ``None`` (none, or stale)."""
        entry = self._entry
        if entry is None or not entry.serves(params, dtype):
            return None
        return entry.blocks

    def put(self, params: Sequence[Tensor], dtype: torch.dtype, blocks: Fp8Blocks) -> None:
        """Hold ``blocks``, the weights ``params`` quantized from ``dtype`` (replacing any entry)."""
        storages = tuple(p.untyped_storage() for p in params)
        self._entry = _Entry(
            tuple(params), storages, _stamps(params), optimizer_steps(), dtype, blocks
        )

    def clear(self) -> None:
        """Drop the entry (its memory goes when no backward holds it)."""
        self._entry = None
