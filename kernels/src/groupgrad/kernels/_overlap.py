"""The overlap rule of the grouped GEMMs: no output's memory meets another output's or an input's.

Address ranges are compared, so two outputs that interleave (for example two
column slices of one matrix) count as overlapping; inputs may overlap each
other. :func:`check_no_overlap` is the rule and names the culprits.
:func:`group_apart` answers the same question for the common case of a
listed group of alike contiguous matrices (``E`` ``main_grad`` buffers, ``E``
weights) next to a few single tensors, in C-speed passes over the group's
addresses instead of one named range per member; when it finds an overlap,
the caller runs :func:`check_no_overlap` for the message.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence

import torch
from torch import Tensor

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


def contiguous_meets(out: Tensor, inputs: tuple[Tensor, ...]) -> bool:
    """Whether the contiguous ``out`` shares memory with one of the contiguous ``inputs``.

    :func:`span` for tensors known to be contiguous, in one pass: what the lean
    checks of the common call (``_lean``) ask before the detailed rule.
    """
    if not out.numel():
        return False
    start, end = out.data_ptr(), out.data_ptr() + out.nbytes
    return any(t.numel() and start < t.data_ptr() + t.nbytes and t.data_ptr() < end for t in inputs)


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
        starts: the members' data addresses, ascending (``_listed.ListedFacts``).
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


def check_experts_apart(out: Tensor) -> None:
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
            f"out[1] overlaps out[0] in memory (out has strides {out.stride()} for shape "
            f"{tuple(out.shape)}); outputs must not overlap each other or the inputs"
        )
