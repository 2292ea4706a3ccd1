"""Token counts per expert (``splits``): host values and device copies.

Legend: ``E`` experts; ``splits_E`` holds how many rows (tokens) of the
row-grouped operand belong to each expert, in order.
"""

from __future__ import annotations

import torch
from torch import Tensor

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
