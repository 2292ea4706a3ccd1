"""What the checks of a listed group read from its members: :class:`ListedFacts`, in one pass.

A listed group (``E`` separate ``(N, K)`` matrices, e.g. each expert's own
``main_grad``) is checked on every call: validation, the overlap rule, the
support check and the direct-call test all need, per member, its type,
shape, dtype, device, layout, ``requires_grad`` and address. Read one
attribute at a time in Python, 128 members cost the host over 100 µs per
call; :func:`listed_facts` reads them once — in C++ when the CUTLASS
extension is loaded and the group is plain CUDA tensors
(``listed_group_facts`` of ``csrc/binding.cpp``, registered by ``_cutlass``),
else in C-speed ``map`` passes — and the checks read the facts. A group that
is not alike gets the detailed per-member checks, whose messages name the
misfit; the facts decide only which checks run, never what they accept.

Legend: ``E`` experts, ``N`` out_features, ``K`` in_features.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

PLAIN_TYPES = frozenset({Tensor, torch.nn.Parameter})
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")

#: ``members -> (alike, requires_grad, sorted addresses)``, or ``None`` when a member
#: is not a plain tensor: the C++ reader, once the CUTLASS extension is loaded.
NativeReader = Callable[[list[Tensor]], "tuple[bool, bool, list[int]] | None"]
_native: list[NativeReader] = []


@dataclasses.dataclass(frozen=True)
class ListedFacts:
    """What one pass over a listed group's members found.

    Attributes:
        alike: every member is a contiguous tensor of the first member's
            shape, dtype and device.
        requires_grad: some member requires grad (read when ``alike``).
        plain: every member is exactly a ``torch.Tensor`` or ``nn.Parameter``.
        starts: the members' data addresses in ascending order, when
            ``alike`` and in real memory (not under ``torch.compile``, not
            meta); else empty.
    """

    alike: bool
    requires_grad: bool
    plain: bool
    starts: tuple[int, ...] = ()


def use_native_reader(reader: NativeReader) -> None:
    """Read plain CUDA groups with ``reader`` from now on (``_cutlass`` calls it on load)."""
    _native[:] = [reader]


def listed_facts(members: Sequence[object], first: Tensor) -> ListedFacts:
    """Read a listed group's members once; ``first`` is ``members[0]``, already checked."""
    kinds = set(map(type, members))
    plain = kinds <= PLAIN_TYPES
    if torch.compiler.is_compiling():  # the same tests, in a loop that Dynamo traces
        alike = all(_alike_one(t, first) for t in members)
        requires_grad = alike and any_requires_grad(members)  # type: ignore[arg-type]
        return ListedFacts(alike, requires_grad, plain=False)
    if not all(issubclass(kind, Tensor) for kind in kinds):
        return ListedFacts(alike=False, requires_grad=False, plain=plain)
    tensors: list[Tensor] = list(members)  # type: ignore[arg-type]
    if plain and _native and first.is_cuda:
        read = _native[0](tensors)
        if read is not None:
            alike, requires_grad, addresses = read
            return ListedFacts(alike, requires_grad, plain, tuple(addresses))
    alike = (
        set(map(_SHAPE, tensors)) == {first.shape}
        and set(map(_DTYPE, tensors)) == {first.dtype}
        and set(map(_DEVICE, tensors)) == {first.device}
        and all(map(Tensor.is_contiguous, tensors))
    )
    if not alike:
        return ListedFacts(alike=False, requires_grad=False, plain=plain)
    requires_grad = any_requires_grad(tensors)
    real = first.device.type != "meta"
    starts = tuple(sorted(map(Tensor.data_ptr, tensors))) if real else ()
    return ListedFacts(alike=True, requires_grad=requires_grad, plain=plain, starts=starts)


def _alike_one(t: object, first: Tensor) -> bool:
    return (
        isinstance(t, Tensor)
        and t.shape == first.shape
        and t.dtype == first.dtype
        and t.device == first.device
        and t.is_contiguous()
    )


def any_requires_grad(tensors: Sequence[Tensor]) -> bool:
    """Whether any of ``tensors`` requires grad (one C-speed pass outside ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return any(t.requires_grad for t in tensors)
    return any(map(_REQUIRES_GRAD, tensors))
