"""Where a group's wgrad GEMM writes, and the checks every such buffer passes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from groupgrad.protocol._distributed import (
    WeightGroup,
    as_weight_list,
    is_distributed_weight,
    members_grad_dtype,
)

__all__ = [
    "check_grad_buffers",
    "member_grad_buffers",
    "packed_grad_buffer",
    "same_device",
    "weight_grad_buffers",
]


def same_device(a: torch.device, b: torch.device) -> bool:
    """Compare devices, treating an index-less CUDA device as the current one."""
    if a.type != b.type:
        return False
    if a.index == b.index or a.type == "cpu":
        return True
    current = torch.cuda.current_device() if a.type == "cuda" else 0
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )


def _byte_extent(tensor: torch.Tensor) -> tuple[int, int]:
    """Return the half-open address range ``[start, end)`` a tensor's elements span."""
    start = tensor.data_ptr()
    if tensor.is_contiguous():
        return start, start + tensor.nbytes
    last = sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return start, start + (last + 1) * tensor.element_size()


def check_grad_buffers(
    buffers: Sequence[torch.Tensor],
    shape: Sequence[int],
    device: torch.device,
) -> None:
    """Check a group's gradient buffers before a GEMM writes them.

    Every buffer must be a tensor of ``shape`` on ``device``, all of one
    dtype, and no two may overlap in memory (a GEMM writing both would race).
    The layout a GEMM needs is the kernels' rule, checked by the GEMM.

    Args:
        buffers: One buffer per group member.
        shape: The shape each buffer must have.
        device: The device each buffer must live on.

    Raises:
        RuntimeError: Naming the member, the expected and the actual value.
    """
    what = "weight grad buffer"
    names = [f"member {i}" for i in range(len(buffers))]
    expected_shape = tuple(shape)
    for index, buffer in enumerate(buffers):
        if (
            isinstance(buffer, torch.Tensor)
            and buffer.shape == expected_shape
            and buffer.dtype == buffers[0].dtype
            and buffer.device == device
            and buffer.is_contiguous()
        ):
            continue  # the common case, in one lean test; the checks below name a misfit
        if not isinstance(buffer, torch.Tensor):
            raise RuntimeError(
                f"{what} of {names[index]} is a {type(buffer).__name__}, expected a torch.Tensor"
            )
        if tuple(buffer.shape) != expected_shape:
            raise RuntimeError(
                f"{what} of {names[index]} has shape {tuple(buffer.shape)}, "
                f"expected {expected_shape}"
            )
        if not same_device(buffer.device, device):
            raise RuntimeError(
                f"{what} of {names[index]} is on device {buffer.device}, expected {device}"
            )
        if buffer.dtype != buffers[0].dtype:
            raise RuntimeError(
                f"{what} of {names[index]} has dtype {buffer.dtype}, expected {buffers[0].dtype} "
                f"like {names[0]} (one dtype across the group)"
            )
    if device.type == "meta":
        return
    extents = sorted(
        (_byte_extent(buffer), index) for index, buffer in enumerate(buffers) if buffer.numel()
    )
    for ((_, end_a), a), ((start_b, _), b) in itertools.pairwise(extents):
        if start_b < end_a:
            first, second = sorted((a, b))
            raise RuntimeError(
                f"{what}s of {names[first]} and {names[second]} overlap in memory; expected "
                "separate storage for every member"
            )


def weight_grad_buffers(
    weights: WeightGroup,
    shape: Sequence[int],
    compute_dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """Return the buffers the group's wgrad GEMM overwrites, one per member.

    Args:
        weights: The group, leader first; a bare weight is a one-member group.
        shape: The shape of one member's weight gradient (the full,
            materialized weight's shape, e.g. ``(N, K)``).
        compute_dtype: The GEMM's input dtype.
        device: Where the GEMM runs.

    Returns:
        Distributed group: each member implementing ``grad_buffer()`` gives
        its own buffer; any other member (a plain follower) gets fresh
        scratch typed by :func:`weight_grad_dtype`. Plain group: one packed
        ``(len(weights), *shape)`` buffer of ``compute_dtype``, as per-member
        views. Contents are undefined: the GEMM overwrites them.

    Raises:
        RuntimeError: A buffer has the wrong shape or device, the dtypes differ
            across the group, or two members' buffers overlap; the message
            names the member index, the expected and the actual value.
    """
    buffers = member_grad_buffers(as_weight_list(weights), shape, compute_dtype, device)
    check_grad_buffers(buffers, shape, torch.device(device))
    return buffers


def member_grad_buffers(
    members: list[torch.Tensor],
    shape: Sequence[int],
    compute_dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """:func:`weight_grad_buffers` for a group normalized by ``as_weight_list``, unchecked.

    The wgrad GEMM that writes them checks them (the kernels' validator), so a
    layer's backward does not check them twice.
    """
    device = torch.device(device)
    shape = tuple(int(s) for s in shape)
    if not is_distributed_weight(members[0]):
        return list(packed_grad_buffer(len(members), shape, compute_dtype, device).unbind(0))

    scratch_dtype = members_grad_dtype(members, compute_dtype)
    buffers: list[torch.Tensor | None] = []
    for member in members:
        provider = getattr(member, "grad_buffer", None)
        buffers.append(provider() if callable(provider) else None)
    missing = [i for i, buffer in enumerate(buffers) if buffer is None]
    if missing:
        scratch = torch.empty((len(missing), *shape), dtype=scratch_dtype, device=device)
        for index, view in zip(missing, scratch.unbind(0), strict=True):
            buffers[index] = view
    return [b for b in buffers if b is not None]


def packed_grad_buffer(
    count: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One ``(count, *shape)`` allocation: a plain group's buffers are its ``unbind(0)`` views.

    A wgrad GEMM handed this tensor whole writes every member's buffer on its
    packed path (one ``(E, N, K)`` output) instead of a list of ``E``.
    """
    return torch.empty((count, *shape), dtype=dtype, device=device)
