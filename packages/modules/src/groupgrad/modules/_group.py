"""A grouped layer's weights as the GEMMs see them, its token counts and its GEMM dtype.

Legend: ``T`` tokens, ``E`` experts (groups), ``K`` in_features,
``N`` out_features.

A layer's parameters come in one of two layouts — ``E`` per-expert ``(N, K)``
parameters, or one packed ``(E, N, K)`` parameter — and may be plain or led by
a ``DistributedWeight``. :class:`WeightGroupSpec` records the layout once, so
the autograd Functions never branch on it (``_wgrad`` runs their wgrad GEMMs).

What a backward uses later is pinned at forward: :func:`snapshot_splits`
copies the token counts, so a caller may refill its buffer at once, and
:func:`device_splits` puts the checked copy on the GPU once for every later
GEMM of the op. Under
``torch.autocast`` an op casts its own operands (:func:`autocast_input`,
:func:`as_gemm_dtype`) and runs with autocast off inside (:func:`no_autocast`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Splits",
    "WeightGroupSpec",
    "as_gemm_dtype",
    "autocast_dtype",
    "autocast_input",
    "check_biases",
    "checks_weight_versions",
    "device_splits",
    "expert_index",
    "no_autocast",
    "snapshot_splits",
]

Splits = Sequence[int] | Tensor
"""``E`` token counts: a sequence of ints, a CPU tensor or a device tensor."""


def snapshot_splits(splits: Splits, num_groups: int) -> Splits:
    """A private copy of ``splits``, taken at forward for every later GEMM of the op.

    A tensor is cloned where it lives (on the device without a host sync, so
    the CUDA-graph path stays capturable); any other iterable (a sequence, a
    generator) becomes a tuple, read once. A traced tensor is copied by an
    opaque op (:func:`_snapshot_op`): a compiled backward reads the copy.
    Values and length are checked by the kernels, not here. Under
    ``torch.compile`` a tensor's length is pinned to ``num_groups`` for the
    tracer (checked when the graph runs): a length traced from data (e.g.
    ``torch.bincount``'s) would otherwise enter the autograd Function as a
    symbol that torch 2.11's tracer rejects.
    """
    if isinstance(splits, Tensor):
        if not torch.compiler.is_compiling():
            return splits.clone()
        if splits.dim() == 1:
            torch._check(splits.shape[0] == num_groups)
        return _snapshot_op(splits)
    if isinstance(splits, Iterable) and not isinstance(splits, str | bytes):
        return tuple(splits)  # once: a generator feeds every GEMM of the op the same counts
    return splits  # not a token count container: the kernels name the problem


@torch.library.custom_op("groupgrad::snapshot_splits", mutates_args=())
def _snapshot_op(splits: Tensor) -> Tensor:
    """``splits.clone()`` as an opaque op, so that a compiled graph saves the copy.

    Inductor's partitioner recomputes a traced ``clone`` in the backward from
    the graph input it copies (a cheap op, rematerialized to save memory), so a
    compiled backward would read the caller's buffer as it is then — after a
    refill (torch 2.13). A custom op is not on its list of recomputable ops.
    """
    return splits.clone()


@_snapshot_op.register_fake
def _snapshot_fake(splits: Tensor) -> Tensor:
    return torch.empty_like(splits)


def device_splits(splits: Splits, device: torch.device) -> Splits:
    """The snapshot's counts as one int64 tensor on ``device``, for the op's later GEMMs.

    Called once per forward, after the forward's first GEMM checked the host
    counts (their values: non-negative, summing to the rows): the later GEMMs
    (the fused MLP's fc2, the dgrads and wgrads, ``backward_dw()``) then take
    the device copy, with no per-call conversion and no host sync. The copy
    goes through fresh pinned memory with ``non_blocking=True``, so the host
    does not wait for it. A device ``splits`` (already there), a CPU device
    and a traced forward (the compiled path hands its counts over itself)
    keep the snapshot as it is.
    """
    if device.type != "cuda" or torch.compiler.is_compiling():
        return splits
    if isinstance(splits, Tensor):
        if splits.device.type != "cpu":
            return splits
        staged = splits.to(torch.int64).pin_memory()
    else:
        staged = torch.tensor(splits, dtype=torch.int64, pin_memory=True)
    return staged.to(device, non_blocking=True)


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` asks for on ``x``'s device, or ``None`` when it is off."""
    device_type = x.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast off on ``device`` inside an op's own forward and backward.

    The op casts its operands itself (to :func:`autocast_dtype`); the reference
    kernels and the elementwise steps must run in the dtypes they are given.
    Under ``torch.compile`` nothing is switched: Dynamo lost autocast's state
    when a Function traced inside a compiled autocast region switched it off
    (torch 2.13, an ``AssertionError`` asking to report a bug), and the ops the
    Functions trace are custom ops, index ops and adds, none on autocast's
    lists (the kernels run at run time, outside the traced region's autocast).
    """
    if (
        device.type in ("cpu", "cuda")
        and torch.is_autocast_enabled(device.type)
        and not torch.compiler.is_compiling()
    ):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def autocast_input(x: Tensor) -> tuple[Tensor, torch.dtype | None]:
    """``x`` in autocast's dtype and that dtype, or ``x`` unchanged and ``None`` without autocast.

    The cast is recorded by autograd (``dx`` is cast back), as ``nn.Linear``'s
    input cast is under autocast.
    """
    dtype = autocast_dtype(x)
    return (x if dtype is None else x.to(dtype)), dtype


def as_gemm_dtype(tensors: Sequence[Tensor], dtype: torch.dtype | None) -> list[Tensor]:
    """``tensors`` cast to autocast's ``dtype`` (unchanged when ``dtype`` is ``None``).

    Without autocast nothing is cast: operands of different dtypes are the
    kernels' to reject, as ``nn.Linear`` rejects them.
    """
    if dtype is None:
        return list(tensors)
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


@dataclass(frozen=True)
class WeightGroupSpec:
    """How one layer's weight parameters map onto a grouped GEMM.

    Attributes:
        names: Parameter names, leader first (``weight0 …`` or ``weight``),
            for error messages.
        packed: One ``(E, N, K)`` parameter holds every expert (else one
            ``(N, K)`` parameter per expert).
        wgrad_into_main_grad: The layer writes its wgrad into ``main_grad``
            (its ``accumulate_into_main_grad`` option).
        checks_versions: Backward refuses weights modified in place since the
            forward (a module's plain parameters, where nothing but the caller
            writes them in between; see :func:`forward_versions`).
    """

    names: tuple[str, ...]
    packed: bool
    wgrad_into_main_grad: bool
    checks_versions: bool = False

    def gemm_weights(self, materialized: Sequence[Tensor]) -> Tensor | list[Tensor]:
        """The materialized weights in the form the grouped kernels take."""
        return materialized[0] if self.packed else list(materialized)

    def num_groups(self, materialized: Sequence[Tensor]) -> int:
        """``E``, read off the materialized weights."""
        return materialized[0].shape[0] if self.packed else len(materialized)


def checks_weight_versions(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward asks its backward to refuse weights modified in place
    since (:attr:`WeightGroupSpec.checks_versions`): with grad, not under ``torch.compile``
    (its graphs check mutations their own way) and not in a module FSDP2's ``fully_shard``
    manages (it gathers the weights into the same tensors again for backward)."""
    return (
        torch.is_grad_enabled() and not torch.compiler.is_compiling() and not fsdp_managed(module)
    )


def fsdp_managed(module: torch.nn.Module) -> bool:
    """Whether FSDP manages ``module`` (``fully_shard`` marks every module it shards): its
    weights are gathered for each forward (and backward) and freed after."""
    return bool(getattr(module, "_is_fsdp_managed_module", False))


def expert_index(splits: Splits, num_groups: int, rows: int, device: torch.device) -> Tensor:
    """Return ``(T,)`` int64: the expert each row belongs to, without a host sync.

    Args:
        splits: ``E`` token counts (sequence, CPU tensor or device tensor).
        num_groups: ``E``.
        rows: ``T``, the number of rows (``sum(splits)``).
        device: Where the index lives.
    """
    counts = torch.as_tensor(splits, dtype=torch.int64)
    if counts.device != device:
        counts = counts.to(device, non_blocking=True)
    experts = torch.arange(num_groups, device=device)
    return torch.repeat_interleave(experts, counts, output_size=rows)


def check_biases(
    biases: Sequence[Tensor], weights: Sequence[Tensor], packed: bool, bias: str, weight: str
) -> None:
    """Each bias shaped and placed like its weight's output: ``(E, N)`` packed, ``(N,)`` per expert.

    Args:
        biases: The layer's biases (one packed tensor, or one per expert).
        weights: The layer's plain weights (``(E, N, K)`` packed, or ``(N, K)`` each).
        packed: The layout.
        bias: How the caller named the biases (e.g. ``"fc1_bias"``).
        weight: How the caller named the weights (e.g. ``"fc1_weights"``).

    Raises:
        ValueError: A bias of another shape or on another device than its weight.
    """
    for index, (b, w) in enumerate(zip(biases, weights, strict=True)):
        b_name, w_name = (bias, weight) if packed else (f"{bias}[{index}]", f"{weight}[{index}]")
        want = tuple(w.shape[:2]) if packed else tuple(w.shape[:1])
        if tuple(b.shape) != want:
            dims = "(E, N)" if packed else "(N,)"
            raise ValueError(
                f"{b_name} has shape {tuple(b.shape)}, expected {dims} = {want} like {w_name}"
            )
        if b.device != w.device:
            raise ValueError(f"{b_name} is on {b.device}, expected {w.device} like {w_name}")
