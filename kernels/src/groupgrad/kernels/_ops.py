"""The ``groupgrad::grouped_{fprop,dgrad,wgrad}`` custom ops, their kernels, and how calls reach them.

Each op writes into its ``out`` argument (declared in ``mutates_args``) and
returns nothing. The default kernel, used on every device but CUDA, is the
pure-PyTorch reference (``_reference``). The fake kernels do nothing — the
output already exists — so ``torch.compile`` traces a call without running
it. Arguments arrive validated by the public functions; groups of matrices
travel in op form (``_group``); ``splits`` is an int32/int64 tensor on the
CPU or the operands' device.

**The CUDA kernels** (``*_on_device``): a call runs on CUTLASS when the
support check (``_support.unsupported_reason``: dtypes, sizes, layout,
alignment; imported with the first CUDA call, like ``build`` whose table
of compiled variants it reads) accepts its operands, the backend module
``groupgrad.kernels._cutlass`` imports (on the first CUDA call, never at
package import), and the backend can run on the operands' device
(``unavailable_reason(device)``: sm_90, a toolchain to build it). Otherwise
the call runs on the reference path and the reason is logged once (per
distinct reason) at WARNING level through this module's logger. The
reference path reads ``splits`` on the host, which synchronizes with the
device when ``splits`` is a device tensor; the CUTLASS path never does. The
backend's contract: arguments validated and accepted by the support check;
``splits`` an int64 tensor on the operands' device; groups in op form:

* ``unavailable_reason(device) -> str | None``
* ``fprop(x_TK, w_group, splits_E, y_TN) -> None``
* ``dgrad(dy_TN, w_group, splits_E, dx_TK) -> None``
* ``wgrad(dy_TN, x_TK, splits_E, dw_group, accumulate) -> None``; ``dw_group``
  holds ``E`` ``(N, K)`` matrices of one dtype (bf16, fp16 or fp32).

**Direct calls.** The public functions call :func:`fprop`, :func:`dgrad` and
:func:`wgrad` here (the SwiGLU ops of ``_swiglu`` follow the same rule). In
plain eager code — plain tensors on the CPU or a CUDA device, nothing tracing
(``torch.compile``, fake or functional tensors, any dispatch or function
mode) and no input that autograd would record — these call the op's kernel
for that device directly (:func:`run_directly`) and bump the version counter
of ``out`` as the op would: the custom-op machinery costs about 50 µs of host
time per call on the H200's host, as much as a whole E = 128 GEMM launch
(measured, ``benchmarks/host_profile.py``). Everything else goes through the
op. A profiler still sees the call as a ``groupgrad::grouped_*`` range.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Literal, ParamSpec, TypeVar

import torch
import torch.utils.checkpoint
from torch import Tensor

from groupgrad.kernels import _group, _reference
from groupgrad.kernels._group import PLAIN_TYPES, ListedFacts, any_requires_grad

_P = ParamSpec("_P")
_R = TypeVar("_R")

_DIRECT_DEVICES = ("cpu", "cuda")


# --------------------------------------------------------------------------- CUDA kernels

logger = logging.getLogger(__name__)

CUTLASS_MODULE = "groupgrad.kernels._cutlass"

_reasons_said: set[str] = set()
_REFERENCE_ROW_GEMMS = {"fprop": _reference.fprop, "dgrad": _reference.dgrad}


def fprop_on_device(
    x: Tensor,
    weights: list[Tensor],
    splits: Tensor,
    out: Tensor,
    *,
    listed: ListedFacts | None = None,
) -> None:
    """CUDA kernel of ``groupgrad::grouped_fprop``: ``y_e = x_e @ w_e.T`` into ``out``.

    ``listed``: what validation's pass over listed weights found (``_group``),
    which spares the support check its own pass.
    """
    _row_grouped_on_device("fprop", x, weights, splits, out, listed)


def dgrad_on_device(
    dy: Tensor,
    weights: list[Tensor],
    splits: Tensor,
    out: Tensor,
    *,
    listed: ListedFacts | None = None,
) -> None:
    """CUDA kernel of ``groupgrad::grouped_dgrad``: ``dx_e = dy_e @ w_e`` into ``out``."""
    _row_grouped_on_device("dgrad", dy, weights, splits, out, listed)


def _row_grouped_on_device(
    op: Literal["fprop", "dgrad"],
    a: Tensor,
    weights: list[Tensor],
    splits: Tensor,
    out: Tensor,
    listed: ListedFacts | None,
) -> None:
    """fprop or dgrad: each expert's rows of ``a`` times its weight into ``out`` (CUTLASS or reference)."""
    if a.shape[0] == 0:
        return
    cutlass, reason = cutlass_or_reason(op, a, weights, out, listed)
    if cutlass is None:
        _say_once(op, reason)
        _REFERENCE_ROW_GEMMS[op](a, weights, splits, out)
    else:
        getattr(cutlass, op)(a, weights, _group.on_device(splits, a.device), out)


def wgrad_on_device(
    dy: Tensor,
    x: Tensor,
    splits: Tensor,
    out: list[Tensor],
    accumulate: bool,
    *,
    listed: ListedFacts | None = None,
) -> None:
    """CUDA kernel of ``groupgrad::grouped_wgrad``: ``dw_e = dy_e.T @ x_e`` into ``out``."""
    dy_TN, x_TK = dy, x
    if x_TK.shape[0] == 0:
        zero_gradient(out, accumulate)
        return
    cutlass, reason = cutlass_or_reason("wgrad", dy_TN, x_TK, out, listed)
    if cutlass is None:
        _say_once("wgrad", reason)
        _reference.wgrad(dy_TN, x_TK, splits, out, accumulate)
    else:
        cutlass.wgrad(dy_TN, x_TK, _group.on_device(splits, x_TK.device), out, accumulate)


def zero_gradient(out: Sequence[Tensor], accumulate: bool) -> None:
    """A wgrad with no tokens at all: ``out`` exactly zero when overwriting, untouched when
    accumulating (the gradient is zero either way)."""
    if accumulate:
        return
    with _reference.writing(out):
        for dw in out:
            dw.zero_()


def cutlass_or_reason(
    op: Literal["fprop", "dgrad", "wgrad"],
    a: Tensor,
    b: Tensor | Sequence[Tensor],
    out: Tensor | Sequence[Tensor],
    listed: ListedFacts | None = None,
) -> tuple[ModuleType | None, str | None]:
    """``(backend, None)`` when CUTLASS runs this validated call, else ``(None, reason)``."""
    reason = support_check().unsupported_reason(op, a, b, out, listed=listed)
    if reason is not None:
        return None, reason
    cutlass, reason = load_cutlass()
    if cutlass is not None:
        reason = cutlass.unavailable_reason(a.device)
    return (cutlass, None) if reason is None else (None, reason)


def fp8_cutlass_or_reason(
    op: str,
    data: list[tuple[str, Tensor]],
    scales: list[tuple[str, Tensor]],
    out: Tensor | Sequence[Tensor],
    listed: ListedFacts | None = None,
    placed: bool = False,
) -> tuple[ModuleType | None, str | None]:
    """``(backend, None)`` when CUTLASS runs this validated FP8 call, else ``(None, reason)``.

    ``data``, ``scales``: ``(name, tensor)`` of the operands' tensors the kernel
    reads, the first data's device deciding; ``out`` the output or the wgrad's group;
    ``placed``: the operands' seals found their tensors placed (only ``out`` is checked).
    """
    cutlass, reason = load_cutlass()
    if cutlass is None:
        return None, reason
    out_dtype = out.dtype if isinstance(out, Tensor) else out[0].dtype
    reason = (
        cutlass.unavailable_reason(data[0][1].device)
        or cutlass.fp8_unsupported_reason(op, out_dtype)
        or support_check().fp8_unsupported_reason(data, scales, out, listed, placed)
    )
    return (cutlass, None) if reason is None else (None, reason)


@functools.cache
def support_check() -> ModuleType:
    """The support check's module, imported on the first CUDA call (it imports ``build``)."""
    from groupgrad.kernels import _support

    return _support


@functools.cache
def load_cutlass() -> tuple[ModuleType | None, str | None]:
    """Import the CUTLASS backend once: ``(module, None)`` or ``(None, reason)``."""
    try:
        return importlib.import_module(CUTLASS_MODULE), None
    except ImportError as error:
        return None, f"the CUTLASS backend cannot be imported ({error})"


def _say_once(op: str, reason: str | None) -> None:
    """Log, once per distinct reason, that ``grouped_<op>`` runs on the reference path."""
    say_once(f"grouped_{op} runs on the reference path: {reason}")


def say_once(message: str) -> None:
    """Log ``message`` at WARNING level the first time it is said (a fallback, said once)."""
    if message not in _reasons_said:
        _reasons_said.add(message)
        logger.warning(message)


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("groupgrad::grouped_fprop", mutates_args=("out",))
def grouped_fprop_op(x: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """Reference kernel: ``y_e = x_e @ w_e.T``; ``x`` (T, K), ``out`` (T, N)."""
    _reference.fprop(x, weights, splits, out)


@torch.library.custom_op("groupgrad::grouped_dgrad", mutates_args=("out",))
def grouped_dgrad_op(dy: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """Reference kernel: ``dx_e = dy_e @ w_e``; ``dy`` (T, N), ``out`` (T, K)."""
    _reference.dgrad(dy, weights, splits, out)


@torch.library.custom_op("groupgrad::grouped_wgrad", mutates_args=("out",))
def grouped_wgrad_op(
    dy: Tensor, x: Tensor, splits: Tensor, out: list[Tensor], accumulate: bool
) -> None:
    """Reference kernel: ``dw_e = dy_e.T @ x_e``, added to or written into ``out``."""
    _reference.wgrad(dy, x, splits, out, accumulate)


grouped_fprop_op.register_kernel("cuda")(fprop_on_device)
grouped_dgrad_op.register_kernel("cuda")(dgrad_on_device)
grouped_wgrad_op.register_kernel("cuda")(wgrad_on_device)


@grouped_fprop_op.register_fake
def _grouped_fprop_fake(x: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    return None


@grouped_dgrad_op.register_fake
def _grouped_dgrad_fake(dy: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    return None


@grouped_wgrad_op.register_fake
def _grouped_wgrad_fake(
    dy: Tensor, x: Tensor, splits: Tensor, out: list[Tensor], accumulate: bool
) -> None:
    return None


def recomputed_under_selective_checkpoint(*ops: Callable[..., object]) -> None:
    """Have selective activation checkpointing always run ``ops`` (custom ops that write
    into ``out`` and return nothing): its modes save and replay what an op returns, so a
    policy saving one would replay nothing, leaving ``out`` unwritten in the recomputation.
    Run, they recompute whatever the policy says, with any other mode stacked."""
    ignored = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", None)
    if ignored is not None:
        ignored.update(op._opoverload for op in ops)  # type: ignore[attr-defined]


recomputed_under_selective_checkpoint(grouped_fprop_op, grouped_dgrad_op, grouped_wgrad_op)


# --------------------------------------------------------------------------- calls


def direct_call_ok(
    tensors: list[Tensor], group: Sequence[Tensor] = (), listed: ListedFacts | None = None
) -> bool:
    """Whether a call on these tensors may run the device kernel without the op machinery.

    True in plain eager code only: every tensor a plain ``Tensor`` or
    ``Parameter`` (no subclass such as fake, functional or distributed
    tensors), on the CPU or a CUDA device, no ``torch.compile`` tracing, no
    dispatch or function mode active, and no input that autograd would record
    (grad mode off, or nothing requiring grad).

    Args:
        tensors: the call's tensors, the first one's device deciding.
        group: the members of a group of matrices, checked like ``tensors``.
        listed: what one pass over ``group`` found (``_group``); when its
            members are alike, their types and ``requires_grad`` are read
            from it instead of from each member.
    """
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
    ):
        return False
    if tensors[0].device.type not in _DIRECT_DEVICES:
        return False
    grad_mode = torch.is_grad_enabled()
    if listed is not None and listed.alike:
        if not listed.plain or (grad_mode and listed.requires_grad):
            return False
    else:
        tensors = [*tensors, *group]
    if not set(map(type, tensors)) <= PLAIN_TYPES:
        return False
    return not (grad_mode and any_requires_grad(tensors))


def run_directly(name: str, kernel: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """``kernel(*args)`` outside the op machinery, in a profiler range named like the op.

    The range is opened only while a profiler is recording, so a profiler
    still sees the call as ``name``.
    """
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.autograd.profiler.record_function(name):
            return kernel(*args, **kwargs)
    return kernel(*args, **kwargs)


def fprop(
    x: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor, listed: ListedFacts | None = None
) -> None:
    """``groupgrad::grouped_fprop`` on validated arguments (directly in plain eager code).

    ``listed``: what validation's pass over listed weights found (``_group``),
    read by the direct-call test and the CUDA kernel's support check instead
    of the members.
    """
    if not direct_call_ok([x, out, splits], weights, listed):
        grouped_fprop_op(x, weights, splits, out)
        return
    kernels = (fprop_on_device, _reference.fprop)
    _run_direct("groupgrad::grouped_fprop", kernels, (x, weights, splits, out), listed)
    torch.autograd.graph.increment_version(out)  # as the op's in-place bookkeeping does


def dgrad(
    dy: Tensor,
    weights: list[Tensor],
    splits: Tensor,
    out: Tensor,
    listed: ListedFacts | None = None,
) -> None:
    """``groupgrad::grouped_dgrad`` on validated arguments (directly in plain eager code)."""
    if not direct_call_ok([dy, out, splits], weights, listed):
        grouped_dgrad_op(dy, weights, splits, out)
        return
    kernels = (dgrad_on_device, _reference.dgrad)
    _run_direct("groupgrad::grouped_dgrad", kernels, (dy, weights, splits, out), listed)
    torch.autograd.graph.increment_version(out)


def wgrad(
    dy: Tensor,
    x: Tensor,
    splits: Tensor,
    out: list[Tensor],
    accumulate: bool,
    listed: ListedFacts | None = None,
) -> None:
    """``groupgrad::grouped_wgrad`` on validated arguments (directly in plain eager code)."""
    if not direct_call_ok([dy, x, splits], out, listed):
        grouped_wgrad_op(dy, x, splits, out, accumulate)
        return
    kernels = (wgrad_on_device, _reference.wgrad)
    _run_direct("groupgrad::grouped_wgrad", kernels, (dy, x, splits, out, accumulate), listed)
    torch.autograd.graph.increment_version(out)


def _run_direct(
    name: str,
    kernels: tuple[Callable[..., None], Callable[..., None]],
    args: tuple[object, ...],
    listed: ListedFacts | None,
) -> None:
    """Run the op's CUDA kernel (``kernels[0]``, given ``listed``) or reference, by ``out``'s device."""
    out = args[3]
    on_cuda = out.is_cuda if isinstance(out, Tensor) else out[0].is_cuda  # type: ignore[index]
    if on_cuda:
        run_directly(name, kernels[0], *args, listed=listed)
    else:
        run_directly(name, kernels[1], *args)
