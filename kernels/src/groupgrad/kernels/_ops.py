"""The ``torch.library`` custom ops ``groupgrad::grouped_{fprop,dgrad,wgrad}``, and how calls reach them.

Each op writes into its ``out`` argument (declared in ``mutates_args``) and
returns nothing. The default kernel, used on every device but CUDA, is the
pure-PyTorch reference; the CUDA kernel (``_dispatch``) runs CUTLASS or falls
back to the reference. The fake kernels do nothing — the output already
exists — so ``torch.compile`` traces a call without running it. Arguments
arrive validated by the public functions; groups of matrices travel in the
form described in ``_grouped``; ``splits`` is an int32/int64 tensor on the CPU
or the operands' device.

The public functions call :func:`fprop`, :func:`dgrad` and :func:`wgrad`
here. In plain eager code — plain tensors on the CPU or a CUDA device, nothing
tracing (``torch.compile``, fake or functional tensors, any dispatch or
function mode) and no input that autograd would record — these call the op's
kernel for that device directly and bump the version counter of ``out`` as
the op would: the custom-op machinery costs about 50 µs of host time per call
on the H200's host, as much as a whole E = 128 GEMM launch (measured,
``benchmarks/host_profile.py``). Everything else goes through the op. A
profiler still sees the call as a ``groupgrad::grouped_*`` range.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from groupgrad.kernels import _dispatch, _reference, _splits
from groupgrad.kernels._grouped import per_expert

_PLAIN_TYPES = (Tensor, torch.nn.Parameter)
_DIRECT_DEVICES = ("cpu", "cuda")


def _fprop_reference(x: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """Reference kernel: ``y_e = x_e @ w_e.T``; ``x`` (T, K), ``out`` (T, N)."""
    host_splits = _splits.host_values(splits, x.shape[0], "x")
    _reference.fprop(x, per_expert(weights), host_splits, out)


def _dgrad_reference(dy: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """Reference kernel: ``dx_e = dy_e @ w_e``; ``dy`` (T, N), ``out`` (T, K)."""
    host_splits = _splits.host_values(splits, dy.shape[0], "dy")
    _reference.dgrad(dy, per_expert(weights), host_splits, out)


def _wgrad_reference(
    dy: Tensor, x: Tensor, splits: Tensor, out: list[Tensor], accumulate: bool
) -> None:
    """Reference kernel: ``dw_e = dy_e.T @ x_e``, added to or written into ``out``."""
    host_splits = _splits.host_values(splits, x.shape[0], "x")
    _reference.wgrad(dy, x, host_splits, per_expert(out), accumulate)


@torch.library.custom_op("groupgrad::grouped_fprop", mutates_args=("out",))
def grouped_fprop_op(x: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """Reference kernel: ``y_e = x_e @ w_e.T``; ``x`` (T, K), ``out`` (T, N)."""
    _fprop_reference(x, weights, splits, out)


@torch.library.custom_op("groupgrad::grouped_dgrad", mutates_args=("out",))
def grouped_dgrad_op(dy: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """Reference kernel: ``dx_e = dy_e @ w_e``; ``dy`` (T, N), ``out`` (T, K)."""
    _dgrad_reference(dy, weights, splits, out)


@torch.library.custom_op("groupgrad::grouped_wgrad", mutates_args=("out",))
def grouped_wgrad_op(
    dy: Tensor, x: Tensor, splits: Tensor, out: list[Tensor], accumulate: bool
) -> None:
    """Reference kernel: ``dw_e = dy_e.T @ x_e``, added to or written into ``out``."""
    _wgrad_reference(dy, x, splits, out, accumulate)


grouped_fprop_op.register_kernel("cuda")(_dispatch.fprop_on_device)
grouped_dgrad_op.register_kernel("cuda")(_dispatch.dgrad_on_device)
grouped_wgrad_op.register_kernel("cuda")(_dispatch.wgrad_on_device)


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


# --------------------------------------------------------------------------- calls


def direct_call_ok(tensors: list[Tensor]) -> bool:
    """Whether a call on these tensors may run the device kernel without the op machinery.

    True in plain eager code only: every tensor a plain ``Tensor`` or
    ``Parameter`` (no subclass such as fake, functional or distributed
    tensors), on the CPU or a CUDA device, no ``torch.compile`` tracing, no
    dispatch or function mode active, and no input that autograd would record
    (grad mode off, or nothing requiring grad).
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
    return all(type(t) in _PLAIN_TYPES and not (grad_mode and t.requires_grad) for t in tensors)


@contextlib.contextmanager
def profiled_range(name: str) -> Iterator[None]:
    """A profiler range named like the op, only while a profiler is recording."""
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.autograd.profiler.record_function(name):
            yield
    else:
        yield


def _run_direct(
    name: str,
    cuda_kernel: Callable[..., None],
    reference: Callable[..., None],
    written: list[Tensor],
    *args: object,
) -> None:
    kernel = cuda_kernel if written[0].device.type == "cuda" else reference
    with profiled_range(name):
        kernel(*args)
    torch.autograd.graph.increment_version(written)  # as the op's in-place bookkeeping does


def fprop(x: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """``groupgrad::grouped_fprop`` on validated arguments (directly in plain eager code)."""
    if direct_call_ok([x, out, splits, *weights]):
        _run_direct(
            "groupgrad::grouped_fprop",
            _dispatch.fprop_on_device,
            _fprop_reference,
            [out],
            x,
            weights,
            splits,
            out,
        )
    else:
        grouped_fprop_op(x, weights, splits, out)


def dgrad(dy: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """``groupgrad::grouped_dgrad`` on validated arguments (directly in plain eager code)."""
    if direct_call_ok([dy, out, splits, *weights]):
        _run_direct(
            "groupgrad::grouped_dgrad",
            _dispatch.dgrad_on_device,
            _dgrad_reference,
            [out],
            dy,
            weights,
            splits,
            out,
        )
    else:
        grouped_dgrad_op(dy, weights, splits, out)


def wgrad(dy: Tensor, x: Tensor, splits: Tensor, out: list[Tensor], accumulate: bool) -> None:
    """``groupgrad::grouped_wgrad`` on validated arguments (directly in plain eager code)."""
    if direct_call_ok([dy, x, splits, *out]):
        _run_direct(
            "groupgrad::grouped_wgrad",
            _dispatch.wgrad_on_device,
            _wgrad_reference,
            out,
            dy,
            x,
            splits,
            out,
            accumulate,
        )
    else:
        grouped_wgrad_op(dy, x, splits, out, accumulate)
