"""What FSDP2 reduce-scatters: a recording comm and the layout of its input buffer.

:class:`RecordingReduceScatter` is FSDP2's default reduce-scatter with a CPU
copy of every input kept; it is installed through FSDP2's public
``FSDPModule.set_custom_reduce_scatter``, so what it records is exactly the
buffer FSDP2 hands the collective.

FSDP2 lays that buffer out as ``(world, per_rank)``: row ``r`` is, for each
parameter of the unit in its order, the ``r``-th dim-0 chunk of its gradient
(dim 0 padded up to a multiple of ``world``), flattened
(``torch.ops.fsdp.chunk_cat``). :func:`segments` maps each parameter to its
slices, so a test can look at one parameter's elements only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter


class RecordingReduceScatter(DefaultReduceScatter):
    """FSDP2's default reduce-scatter, keeping ``{"unit", "input"}`` (a CPU copy) per call."""

    def __init__(self, unit: str, log: list[dict[str, Any]]) -> None:
        self.unit = unit
        self.log = log

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
        self.log.append({"unit": self.unit, "input": input_tensor.detach().cpu().clone()})
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def record(model: nn.Module, units: Sequence[str], log: list[dict[str, Any]]) -> None:
    """Install a recorder on every FSDP unit of ``model`` (named by their qualified names)."""
    for name in units:
        model.get_submodule(name).set_custom_reduce_scatter(RecordingReduceScatter(name, log))


def unit_param_names(model: nn.Module, unit_name: str) -> list[str]:
    """Qualified names of the parameters one FSDP unit manages, in FSDP2's order."""
    unit = model.get_submodule(unit_name)
    prefix = f"{unit_name}." if unit_name else ""
    names: list[str] = []
    skipped: list[str] = []
    for sub_name, sub in unit.named_modules():
        if sub is not unit and isinstance(sub, FSDPModule):
            skipped.append(f"{sub_name}.")
            continue
        if any(sub_name.startswith(s) for s in skipped):
            continue
        for param_name, _ in sub.named_parameters(recurse=False):
            names.append(prefix + (f"{sub_name}.{param_name}" if sub_name else param_name))
    return names


def segments(
    buffer: Tensor, names: Sequence[str], shapes: Mapping[str, torch.Size], world: int
) -> dict[str, Tensor]:
    """Each parameter's elements of one reduce-scatter input, concatenated over the rows.

    Raises:
        AssertionError: The parameters do not fill the buffer exactly (the
            layout assumption is wrong).
    """
    chunks = {}
    for name in names:
        rows = math.ceil(shapes[name][0] / world)
        chunks[name] = rows * math.prod(shapes[name][1:])
    per_rank = sum(chunks.values())
    assert buffer.numel() == world * per_rank, (buffer.numel(), world, per_rank)
    table = buffer.view(world, per_rank)
    found: dict[str, Tensor] = {}
    offset = 0
    for name in names:
        found[name] = table[:, offset : offset + chunks[name]].flatten()
        offset += chunks[name]
    return found


def representable_in_bf16(t: Tensor) -> float:
    """Fraction of ``t``'s elements that bf16 holds exactly (1.0 for an empty tensor)."""
    if t.numel() == 0:
        return 1.0
    return float((t.to(torch.bfloat16).to(t.dtype) == t).double().mean())
