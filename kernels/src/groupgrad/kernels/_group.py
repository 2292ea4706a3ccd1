"""A group of ``E`` matrices and its token counts: the vocabulary every grouped GEMM call shares.

Legend: ``T`` tokens, ``E`` experts, ``N`` out_features, ``K`` in_features;
``splits_E`` holds how many rows of the row-grouped operand belong to each
expert, in order.

**Op form.** A group of ``E`` ``(N, K)`` matrices (weights, wgrad outputs)
travels to a custom op as a ``list[Tensor]``: packed, ``[w_ENK]`` (one
``(E, N, K)`` tensor), or listed, ``[w_NK, w_NK, …]``. Passing a packed
tensor whole keeps the mutated arguments of an op from aliasing each other
(functionalization and ``torch.library.opcheck`` require it) and lets the
CUTLASS kernels address the matrices by stride; :func:`per_expert` gives the
reference its ``E`` matrices.

**Listed facts.** A listed group (e.g. each expert's own ``main_grad``) is
read once per call (:func:`listed_facts`: in C++ when the CUTLASS extension
is loaded and the group is plain CUDA tensors, else in C-speed ``map``
passes): validation, the overlap rule, the support check and the direct-call
test read the facts instead of 128 members one attribute at a time. The
facts decide only which checks run, never what they accept.

**The overlap rule.** No output's memory meets another output's or an
input's (address ranges compared, so interleaving outputs overlap; inputs may
overlap each other). :func:`check_no_overlap` is the rule and names the
culprits; :func:`group_apart` and :func:`contiguous_meets` answer the same
question cheaply for alike contiguous members and single tensors, and
:func:`check_experts_apart` for a packed output.

**Token counts.** :func:`check_values` (non-negative, summing to the rows),
:func:`host_values` (the reference reads them, a sync for a device tensor)
and :func:`on_device` (the int64 device copy the CUDA kernels read, without a
host sync).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# ------------------------------------------------------------------ op form


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


# ------------------------------------------------------------------ listed facts

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


def dense(t: Tensor) -> bool:
    """Not sparse, mkldnn or nested (traced, not asked: Dynamo refuses ``layout`` there)."""
    return torch.compiler.is_compiling() or _strided(t)


def _strided(t: Tensor) -> bool:
    """:func:`dense` in eager code."""
    return t.layout == torch.strided and not t.is_nested


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
        all(map(_strided, tensors))  # eager here: not compiling
        and set(map(_SHAPE, tensors)) == {first.shape}
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


# ------------------------------------------------------------------ the overlap rule

Named = tuple[str, Tensor]


def skipped(t: Tensor) -> bool:
    """Whether the rule is not checked: tracing (no real memory) or meta tensors."""
    return torch.compiler.is_compiling() or t.device.type == "meta"


def span(t: Tensor) -> tuple[int, int] | None:
    """Byte range ``[start, end)`` that ``t`` can touch, or ``None`` when empty."""
    if t.numel() == 0:
        return None
    if t.is_contiguous():
        return t.data_ptr(), t.data_ptr() + t.nbytes
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def contiguous_meets(out: Tensor, inputs: Sequence[Tensor]) -> bool:
    """Whether the contiguous ``out`` shares memory with one of ``inputs``.

    :func:`span` in one pass, the contiguous inputs' ends read off ``nbytes``: what the
    cheap tests of the common call (``_rules``) ask before the detailed rule. An input
    with gaps (padded rows) spans more than its bytes.
    """
    if not out.numel():
        return False
    start = out.data_ptr()
    end = start + out.nbytes
    for t in inputs:  # each address read once; an empty input (touching nothing) last
        if t.is_contiguous():
            p = t.data_ptr()
            if start < p + t.nbytes and p < end and t.numel():
                return True
        elif (reach := span(t)) is not None and start < reach[1] and reach[0] < end:
            return True
    return False


def check_no_overlap(outputs: Sequence[Named], inputs: Sequence[Named]) -> None:
    """Raise ``ValueError`` if an output's range meets another output's or an input's.

    One sweep over the ranges sorted by start: O((outputs + inputs) log(...)).
    """
    if skipped(outputs[0][1]):
        return
    spans = []
    for is_output, named in ((True, outputs), (False, inputs)):
        for name, t in named:
            reach = span(t)
            if reach is not None:
                spans.append((reach[0], reach[1], is_output, name))
    spans.sort(key=lambda s: s[0])
    reach_any: tuple[int, str] | None = None  # furthest end so far, and whose
    reach_out: tuple[int, str] | None = None  # the same among outputs
    for start, end, is_output, name in spans:
        earlier = reach_any if is_output else reach_out
        if earlier is not None and start < earlier[0]:
            first, second = (name, earlier[1]) if is_output else (earlier[1], name)
            raise ValueError(
                f"{first} overlaps {second} in memory; "
                "outputs must not overlap each other or the inputs"
            )
        if reach_any is None or end > reach_any[0]:
            reach_any = (end, name)
        if is_output and (reach_out is None or end > reach_out[0]):
            reach_out = (end, name)


def group_apart(
    starts: Sequence[int], width: int, group_is_output: bool, singles: Sequence[tuple[Tensor, bool]]
) -> bool:
    """Whether :func:`check_no_overlap` passes, for alike contiguous group members.

    Args:
        starts: the members' data addresses, ascending (:class:`ListedFacts`).
        width: the bytes each member spans (contiguous members of one shape and
            dtype: ``nbytes`` alike); 0 for empty members, which touch nothing.
        group_is_output: the members are outputs (they must also be apart
            from each other) or inputs.
        singles: the other operands, each with whether it is an output.

    Returns:
        ``True`` when no output meets another output or an input; ``False``
        when one does (the caller then runs :func:`check_no_overlap`, which
        raises naming them).
    """
    if not width:
        starts = ()
    if (
        group_is_output
        and len(starts) > 1
        and min(map(operator.sub, starts[1:], starts[:-1])) < width
    ):
        return False
    reaches = [(reach, is_output) for t, is_output in singles if (reach := span(t)) is not None]
    for i, ((start, end), is_output) in enumerate(reaches):
        if starts and (is_output or group_is_output):
            first = bisect.bisect_right(starts, start - width)  # first member ending after start
            if first < len(starts) and starts[first] < end:
                return False
        for (other_start, other_end), other_is_output in reaches[:i]:
            if (is_output or other_is_output) and start < other_end and other_start < end:
                return False
    return True


def check_experts_apart(out: Tensor, name: str = "out") -> None:
    """Raise unless each expert's matrix of a row-major ``(E, N, K)`` tensor ends before the next starts.

    The packed form of the overlap rule (outputs whose address ranges meet or
    interleave overlap), in O(1) instead of one range per expert.
    """
    E, N, K = out.shape
    if E < 2 or N == 0 or K == 0:
        return
    reach = (N - 1) * out.stride(1) + (K - 1) * out.stride(2) + 1  # elements one matrix reaches
    if out.stride(0) < reach:
        raise ValueError(
            f"{name}[1] overlaps {name}[0] in memory ({name} has strides {out.stride()} for shape "
            f"{tuple(out.shape)}); outputs must not overlap each other or the inputs"
        )


# ------------------------------------------------------------------ token counts

SPLITS_DTYPES = (torch.int32, torch.int64)


def counts_fit(values: list[int], rows: int) -> bool:
    """Whether ``values`` are non-negative and sum to ``rows`` (``min`` and ``sum`` run in C:
    an ``E = 128`` list costs about a microsecond)."""
    return not (values and min(values) < 0) and sum(values) == rows


def check_values(values: list[int], rows: int, rows_name: str) -> None:
    """Raise ``ValueError`` unless ``values`` are non-negative and sum to ``rows``.

    The index of a negative count is looked for only once :func:`counts_fit`
    says something is wrong.
    """
    if counts_fit(values, rows):
        return
    if values and min(values) < 0:
        index = next(i for i, count in enumerate(values) if count < 0)
        raise ValueError(f"splits[{index}] is {values[index]}, expected a token count >= 0")
    total = sum(values)
    if total != rows:
        raise ValueError(f"splits sums to {total} but {rows_name} has {rows} rows")


def host_values(splits_E: Tensor, rows: int, rows_name: str) -> list[int]:
    """The token counts as Python ints, checked against ``rows``.

    Reading a device tensor synchronizes the host with the device; only the
    reference path does this (the CUTLASS path never reads ``splits`` on the
    host).
    """
    values: list[int] = splits_E.tolist()
    check_values(values, rows, rows_name)
    return values


def on_device(splits_E: Tensor, device: torch.device) -> Tensor:
    """``splits_E`` as a contiguous int64 tensor on ``device``, without a host sync.

    What the CUDA kernels read. A CPU tensor is staged through a fresh pinned
    buffer and copied asynchronously (PyTorch's caching host allocator keeps
    the buffer alive until the copy has run); a device tensor is converted on
    the device, and passes through untouched when it already is one.
    """
    if splits_E.dtype == torch.int64 and splits_E.device == device and splits_E.is_contiguous():
        return splits_E  # the common case: nothing to convert
    if splits_E.device.type == "cpu" and device.type != "cpu":
        staged = torch.empty(splits_E.shape, dtype=torch.int64, pin_memory=True)
        staged.copy_(splits_E)
        return staged.to(device, non_blocking=True)
    return splits_E.to(device=device, dtype=torch.int64).contiguous()


# ------------------------------------------------------------------ naming members, the rule on a group

Labeler = Callable[[int | None], str]
"""How messages name a group: ``label(None)`` the group, ``label(e)`` its member ``e``."""


def labeler(default: str, names: object) -> Labeler:
    """Name member ``e`` ``names[e]`` and a packed group ``names[0]``; else ``default[e]``, ``default``.

    Names only shape messages: where ``names`` has no entry for a member the
    default name is used.

    Raises:
        TypeError: ``names`` is neither ``None`` nor a sequence of strings.
    """
    given: list[str] = []
    if names is not None:
        if isinstance(names, str | bytes) or not isinstance(names, Sequence):
            raise TypeError(f"names is a {type(names).__name__}, expected a sequence of str")
        given = list(names)
        if not all(map(isinstance, given, itertools.repeat(str))):
            raise TypeError("names holds an entry that is not a str, expected a sequence of str")

    def label(e: int | None) -> str:
        if e is None:
            return given[0] if len(given) == 1 else default
        return given[e] if e < len(given) else f"{default}[{e}]"

    return label


def check_group_apart(
    group_name: str | Labeler,
    group: list[Tensor],
    listed: ListedFacts | None,
    outputs: list[tuple[str, Tensor]],
    inputs: list[tuple[str, Tensor]],
) -> None:
    """The overlap rule for a group in op form beside the call's single ``outputs`` and ``inputs``.

    The group is the outputs (wgrad: ``outputs`` is then empty) or, with any
    ``outputs``, inputs (the weights). Alike listed members take the lean
    sweep over their sorted addresses (``listed.starts``, empty unless
    alike); the named check runs where there is no such sweep or it finds an
    overlap, and raises naming the culprits.
    """
    group_is_output = not outputs
    starts = listed.starts if listed is not None else ()
    singles = [(t, True) for _, t in outputs] + [(t, False) for _, t in inputs]
    if starts and group_apart(starts, group[0].nbytes, group_is_output, singles):
        return
    named = named_members(group_name, group)
    if group_is_output:
        check_no_overlap(named, inputs)
    else:
        check_no_overlap(outputs, [*inputs, *named])


def named_members(label: str | Labeler, group: list[Tensor]) -> list[tuple[str, Tensor]]:
    """Each tensor of a group in op form with the name an error message gives it."""
    name = labeler(label, None) if isinstance(label, str) else label
    if is_packed(group):
        return [(name(None), group[0])]
    return [(name(i), t) for i, t in enumerate(group)]
