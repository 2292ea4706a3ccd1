"""SwiGLU × router probabilities: the elementwise step between a grouped MLP's two GEMMs.

Legend: ``T`` tokens, ``F`` ffn_hidden_size; ``h_T2F`` is fc1's output (gate
``g = h[:, :F]`` then up ``u = h[:, F:]``), ``probs_T`` the router
probability of each token, ``a_TF`` the activation fed to fc2::

    a = silu(g) * u * probs[:, None]        silu(g) = g * sigmoid(g)

Backward, from ``da_TF``, in one pass that also recomputes ``a`` (so forward
need not save it — fc2's wgrad reads the recomputed copy)::

    dprobs = sum_f(da * silu(g) * u)
    dg     = da * probs * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    du     = da * probs * silu(g)

Everything is computed in fp32 (the reference: fp64 for fp64 inputs) and rounded once into ``h``'s dtype (``a``,
``dh``) or ``probs``' dtype (``dprobs``). ``a`` is computed by the same
expression in forward and backward, so the recomputed ``a`` is the one forward
used (bit for bit on the reference path).

Two implementations with the same signatures: the pure-PyTorch reference
(``*_ref``, any device) and fused Triton kernels (``_swiglu_triton``, one pass
each way), which the CUDA kernels of the ``groupgrad::swiglu_probs*`` custom
ops run. Triton is imported on the first CUDA call, never at package import;
without it CUDA runs the reference and says so once through ``logging``.
Plain eager calls skip the custom-op machinery as the grouped GEMMs do
(``_ops.direct_call_ok``). Autograd lives in ``groupgrad.modules``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch
from torch import Tensor

from groupgrad.kernels._ops import direct_call_ok, run_directly
from groupgrad.kernels._rules import INPUT_DTYPES, check_unrecorded, tensor_arg

__all__ = [
    "swiglu_probs",
    "swiglu_probs_backward",
    "swiglu_probs_backward_ref",
    "swiglu_probs_ref",
]

logger = logging.getLogger(__name__)

TRITON_MODULE = "groupgrad.kernels._swiglu_triton"


# ---------------------------------------------------------------- reference


def _gate_and_up(h_T2F: Tensor) -> tuple[Tensor, Tensor]:
    """Gate and up halves in the math dtype: fp32 (fp64 for fp64 input, as a test oracle)."""
    math_dtype = torch.promote_types(h_T2F.dtype, torch.float32)
    g_TF, u_TF = h_T2F.to(math_dtype).chunk(2, dim=1)
    return g_TF, u_TF


def swiglu_probs_ref(h_T2F: Tensor, probs_T: Tensor | None = None) -> Tensor:
    """Pure-PyTorch twin of :func:`swiglu_probs`: ``silu(h[:, :F]) * h[:, F:] * probs[:, None]``.

    Runs on any device; the math is fp32 (fp64 for fp64 inputs), rounded once
    into ``h``'s dtype. Nothing is mutated. The arguments are checked as
    :func:`swiglu_probs` checks them (fp64 ``h`` allowed).

    Args:
        h_T2F: ``(T, 2F)`` fc1 output, gate columns first then up columns;
            bf16, fp16, fp32 (or fp64, as a test oracle).
        probs_T: ``(T,)`` per-token scale (router probabilities), any floating
            dtype, on ``h``'s device, or ``None`` for ones.

    Returns:
        ``a_TF``: a new ``(T, F)`` tensor in ``h``'s dtype.

    Raises:
        ValueError, TypeError: As :func:`swiglu_probs`.
    """
    check_swiglu_args(h_T2F, probs_T, oracle=True)
    return swiglu_math(h_T2F, probs_T)


def swiglu_math(h_T2F: Tensor, probs_T: Tensor | None) -> Tensor:
    """:func:`swiglu_probs_ref` of checked arguments (the ops' reference kernel)."""
    g_TF, u_TF = _gate_and_up(h_T2F)
    a_TF = g_TF * torch.sigmoid(g_TF) * u_TF
    if probs_T is not None:
        a_TF = a_TF * probs_T.to(a_TF.dtype)[:, None]
    return a_TF.to(h_T2F.dtype)


def swiglu_probs_backward_ref(
    da_TF: Tensor, h_T2F: Tensor, probs_T: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Pure-PyTorch twin of :func:`swiglu_probs_backward`, which also recomputes ``a``.

    Runs on any device, in fp32 math (fp64 for fp64 inputs), each result
    rounded once. Nothing is mutated.

    Args:
        da_TF: ``(T, F)`` gradient of the activation, any floating dtype;
            rounded to ``h``'s dtype first, as :func:`swiglu_probs_backward`
            takes it.
        h_T2F: ``(T, 2F)`` fc1 output saved by forward (gate then up), bf16,
            fp16, fp32 or fp64.
        probs_T: ``(T,)`` the forward's ``probs``, any floating dtype, on
            ``h``'s device, or ``None``.

    Returns:
        ``(dh_T2F, dprobs_T, a_TF)``: new tensors; ``dh`` ``(T, 2F)`` and ``a``
        ``(T, F)`` in ``h``'s dtype, ``dprobs`` ``(T,)`` in ``probs``' dtype
        (``None`` without ``probs``); ``a`` equals :func:`swiglu_probs_ref`'s
        output bit for bit.

    Raises:
        ValueError, TypeError: As :func:`swiglu_probs_backward`.
    """
    check_swiglu_backward_args(da_TF, h_T2F, probs_T, oracle=True)
    return swiglu_backward_math(da_TF, h_T2F, probs_T)


def swiglu_backward_math(
    da_TF: Tensor, h_T2F: Tensor, probs_T: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`swiglu_probs_backward_ref` of checked arguments (the ops' reference kernel)."""
    g_TF, u_TF = _gate_and_up(h_T2F)
    sig_TF = torch.sigmoid(g_TF)
    silu_TF = g_TF * sig_TF
    act_TF = silu_TF * u_TF
    da_TF = da_TF.to(h_T2F.dtype).to(g_TF.dtype)
    dprobs_T = None
    if probs_T is not None:
        p_T1 = probs_T.to(g_TF.dtype)[:, None]
        dprobs_T = (da_TF * act_TF).sum(dim=1).to(probs_T.dtype)
        act_TF = act_TF * p_T1
        da_TF = da_TF * p_T1
    dg_TF = da_TF * u_TF * sig_TF * (1.0 + g_TF * (1.0 - sig_TF))
    du_TF = da_TF * silu_TF
    dh_T2F = torch.cat([dg_TF, du_TF], dim=1).to(h_T2F.dtype)
    return dh_T2F, dprobs_T, act_TF.to(h_T2F.dtype)


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("groupgrad::swiglu_probs", mutates_args=())
def swiglu_probs_op(h: Tensor, probs: Tensor | None) -> Tensor:
    """Default kernel (every device but CUDA): the reference. ``h`` (T, 2F) -> ``a`` (T, F)."""
    return swiglu_math(h, probs)


def swiglu_probs_backward_op_ref(
    da: Tensor, h: Tensor, probs: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Default kernel of the backward op: the reference, ``dprobs`` ``(0,)`` without ``probs``."""
    dh, dprobs, a = swiglu_backward_math(da, h, probs)
    return dh, _dprobs_or_empty(dprobs, h), a


@torch.library.custom_op("groupgrad::swiglu_probs_backward", mutates_args=())
def swiglu_probs_backward_op(
    da: Tensor, h: Tensor, probs: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Default kernel: the reference. Returns ``(dh, dprobs, a)``; ``dprobs`` is ``(0,)`` without ``probs``."""
    return swiglu_probs_backward_op_ref(da, h, probs)


def _dprobs_or_empty(dprobs: Tensor | None, h: Tensor) -> Tensor:
    return h.new_empty(0, dtype=torch.float32) if dprobs is None else dprobs


@swiglu_probs_op.register_fake
def _swiglu_probs_fake(h: Tensor, probs: Tensor | None) -> Tensor:
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@swiglu_probs_backward_op.register_fake
def _swiglu_probs_backward_fake(
    da: Tensor, h: Tensor, probs: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    dprobs = h.new_empty(0, dtype=torch.float32) if probs is None else torch.empty_like(probs)
    return torch.empty_like(h), dprobs, torch.empty_like(da)


@functools.cache
def load_triton_kernels() -> tuple[ModuleType | None, str | None]:
    """Import the Triton kernels once: ``(module, None)`` or ``(None, reason)``."""
    try:
        return importlib.import_module(TRITON_MODULE), None
    except ImportError as error:
        return None, f"triton cannot be imported ({error})"


def _triton_or_say_why() -> ModuleType | None:
    kernels, reason = load_triton_kernels()
    if kernels is None:
        _say_once(f"SwiGLU runs on the PyTorch reference on CUDA: {reason}")
    return kernels


@functools.cache
def _say_once(message: str) -> None:
    logger.warning(message)


@swiglu_probs_op.register_kernel("cuda")
def _swiglu_probs_cuda(h: Tensor, probs: Tensor | None) -> Tensor:
    kernels = _triton_or_say_why()
    if kernels is None:
        return swiglu_math(h, probs)
    return kernels.swiglu_probs_triton(h, probs)


@swiglu_probs_backward_op.register_kernel("cuda")
def _swiglu_probs_backward_cuda(
    da: Tensor, h: Tensor, probs: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    kernels = _triton_or_say_why()
    if kernels is None:
        dh, dprobs, a = swiglu_backward_math(da, h, probs)
    else:
        dh, dprobs, a = kernels.swiglu_probs_backward_triton(da, h, probs)
    return dh, _dprobs_or_empty(dprobs, h), a


# ---------------------------------------------------------------- public entry points


def check_swiglu_args(
    h_T2F: Tensor, probs_T: Tensor | None, *, oracle: bool = False, op: str = "swiglu_probs"
) -> None:
    """The public ops' arguments: ``h`` a ``(T, 2F)`` bf16/fp16/fp32 tensor (fp64 too for
    the ``*_ref`` twins, the test oracles: ``oracle``), ``probs`` ``(T,)`` floating on
    ``h``'s device; neither recorded by autograd (``op``, not differentiable, names itself)."""
    dtypes = (*INPUT_DTYPES, torch.float64) if oracle else INPUT_DTYPES
    if not isinstance(h_T2F, Tensor) or h_T2F.dtype not in dtypes:
        what = h_T2F.dtype if isinstance(h_T2F, Tensor) else type(h_T2F).__name__
        also = " or torch.float64" if oracle else ""
        raise TypeError(
            f"h has dtype {what}, expected torch.bfloat16, torch.float16 or torch.float32{also}"
        )
    check_elementwise_tensors(op, h=h_T2F, probs=probs_T)
    if h_T2F.dim() != 2 or h_T2F.shape[1] % 2:
        raise ValueError(
            f"h has shape {tuple(h_T2F.shape)}, expected (T, 2F): gate and up halves side by side"
        )
    check_probs(probs_T, h_T2F.shape[0], h_T2F.device)


def check_swiglu_backward_args(
    da_TF: Tensor, h_T2F: Tensor, probs_T: Tensor | None, *, oracle: bool = False
) -> None:
    """:func:`check_swiglu_args`, and ``da`` a floating ``(T, F)`` tensor on ``h``'s device."""
    check_swiglu_args(h_T2F, probs_T, oracle=oracle, op="swiglu_probs_backward")
    expected = (h_T2F.shape[0], h_T2F.shape[1] // 2)
    if not isinstance(da_TF, Tensor) or not da_TF.dtype.is_floating_point:
        what = da_TF.dtype if isinstance(da_TF, Tensor) else type(da_TF).__name__
        raise TypeError(f"da has dtype {what}, expected a floating-point tensor")
    check_elementwise_tensors("swiglu_probs_backward", da=da_TF)
    if da_TF.device != h_T2F.device:
        raise ValueError(f"da is on {da_TF.device}, expected h's device {h_T2F.device}")
    if tuple(da_TF.shape) != expected:
        raise ValueError(f"da has shape {tuple(da_TF.shape)}, expected (T, F) = {expected}")


def check_elementwise_tensors(op: str, **tensors: object) -> None:
    """The elementwise ops' tensor arguments (a non-tensor is left to the caller's checks):
    dense, and not recorded by autograd, for the ops and their ``*_ref`` twins alike."""
    given = [(name, tensor_arg(name, t)) for name, t in tensors.items() if isinstance(t, Tensor)]
    check_unrecorded(op, given, None)


def check_probs(probs_T: Tensor | None, T: int, device: torch.device) -> None:
    """``probs``: ``None``, or a floating ``(T,)`` tensor on ``device`` (``h``'s)."""
    if probs_T is None:
        return
    if not isinstance(probs_T, Tensor) or not probs_T.dtype.is_floating_point:
        what = probs_T.dtype if isinstance(probs_T, Tensor) else type(probs_T).__name__
        raise TypeError(f"probs has dtype {what}, expected a floating-point tensor")
    if tuple(probs_T.shape) != (T,):
        raise ValueError(f"probs has shape {tuple(probs_T.shape)}, expected (T,) = ({T},)")
    if probs_T.device != device:
        raise ValueError(f"probs is on {probs_T.device}, expected h's device {device}")


def swiglu_probs(h_T2F: Tensor, probs_T: Tensor | None = None) -> Tensor:
    """SwiGLU × router probabilities: ``a = silu(h[:, :F]) * h[:, F:] * probs[:, None]``.

    The fused MLP's elementwise step between its two grouped GEMMs. On CUDA
    a fused Triton kernel runs (the reference when triton cannot be
    imported, said once through :mod:`logging`); on every other device the
    reference (:func:`swiglu_probs_ref`). The math is fp32, rounded once.
    Runs as the custom op ``groupgrad::swiglu_probs`` (so ``torch.compile``
    and CUDA graphs see it). Not differentiable: autograd lives in
    ``groupgrad.modules``. Nothing is mutated.

    Args:
        h_T2F: ``(T, 2F)`` fc1 output, gate columns first then up columns;
            bf16, fp16 or fp32 (need not be contiguous).
        probs_T: ``(T,)`` per-token scale (router probabilities), any
            floating dtype, on ``h``'s device, or ``None`` for ones.

    Returns:
        ``a_TF``: a new contiguous ``(T, F)`` tensor in ``h``'s dtype.

    Raises:
        ValueError: ``h`` is not ``(T, 2F)`` or ``probs`` is not ``(T,)`` on
            ``h``'s device.
        TypeError: ``h`` is not bf16, fp16 or fp32, or ``probs`` is not
            floating-point (fp64 and other dtypes are for the ``*_ref`` twin).
    """
    check_swiglu_args(h_T2F, probs_T)
    h, probs = h_T2F.contiguous(), None if probs_T is None else probs_T.contiguous()
    if _direct_ok(h, probs):
        kernel = _swiglu_probs_cuda if h.is_cuda else swiglu_math
        return run_directly("groupgrad::swiglu_probs", kernel, h, probs)
    return swiglu_probs_op(h, probs)


def swiglu_probs_backward(
    da_TF: Tensor, h_T2F: Tensor, probs_T: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Backward of :func:`swiglu_probs` in one pass, recomputing the activation.

    ``dprobs = sum_f(da * silu(g) * u)``, ``dg = da * probs * u * sigmoid(g) *
    (1 + g * (1 - sigmoid(g)))``, ``du = da * probs * silu(g)``, and ``a`` as
    forward computed it (so forward need not keep it). Backend choice, math
    and op machinery as in :func:`swiglu_probs` (custom op
    ``groupgrad::swiglu_probs_backward``). Nothing is mutated.

    Args:
        da_TF: ``(T, F)`` gradient of the activation; cast to ``h``'s dtype.
        h_T2F: ``(T, 2F)`` fc1 output saved by forward, bf16, fp16 or fp32.
        probs_T: ``(T,)`` the forward's per-token scale, any floating dtype,
            or ``None``.

    Returns:
        ``(dh_T2F, dprobs_T, a_TF)``: ``dh`` ``(T, 2F)`` and the recomputed
        activation ``a`` ``(T, F)`` in ``h``'s dtype, ``dprobs`` ``(T,)`` in
        ``probs``' dtype (``None`` without ``probs``); all new contiguous
        tensors.

    Raises:
        ValueError: ``h`` is not ``(T, 2F)``, ``da`` not ``(T, F)`` or
            ``probs`` not ``(T,)``, or either is not on ``h``'s device.
        TypeError: ``h`` is not bf16, fp16 or fp32, or ``da`` or ``probs``
            is not floating-point.
    """
    check_swiglu_backward_args(da_TF, h_T2F, probs_T)
    probs = None if probs_T is None else probs_T.contiguous()
    da, h = da_TF.contiguous().to(h_T2F.dtype), h_T2F.contiguous()
    if _direct_ok(h, probs, da):
        kernel = _swiglu_probs_backward_cuda if h.is_cuda else swiglu_probs_backward_op_ref
        dh, dprobs, a = run_directly("groupgrad::swiglu_probs_backward", kernel, da, h, probs)
    else:
        dh, dprobs, a = swiglu_probs_backward_op(da, h, probs)
    return dh, None if probs_T is None else dprobs, a


def _direct_ok(*tensors: Tensor | None) -> bool:
    """Plain eager code: run the op's kernel without the custom-op machinery (see
    ``groupgrad.kernels._ops``: the same rule, about 50 µs of host time saved per call)."""
    return direct_call_ok([t for t in tensors if t is not None])
