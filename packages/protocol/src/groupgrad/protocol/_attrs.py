"""The ``main_grad`` attribute contract: the only place that reads framework attributes.

Training frameworks (Megatron-LM, Megatron-FSDP, ...) put these attributes on
parameters; groupgrad reads them here and nowhere else:

==========================  =================================================
attribute                    meaning
==========================  =================================================
``main_grad``                the framework's gradient buffer (usually fp32)
``__fsdp_param__`` +         Megatron-FSDP: ``get_main_grad()`` hands out the
``get_main_grad()``          buffer (once per backward; maybe uninitialised)
``overwrite_main_grad``      truthy: the wgrad GEMM overwrites (beta = 0)
``grad_added_to_main_grad``  present: set ``True`` once written; autograd
                             receives a zero dummy instead of ``None``
``zero_out_wgrad``           truthy: the dummy is re-zeroed before each use
``grad_dtype`` (PyTorch)     the dtype of the gradient autograd receives (and
                             of the dummy); a bf16 parameter may ask for fp32
==========================  =================================================
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch

__all__ = [
    "MAIN_GRAD_DTYPES",
    "deliver_to_main_grad",
    "drop_dummy_grads",
    "dummy_wgrad",
    "fetch_main_grad",
    "grad_dtype_of",
    "is_fsdp_param",
    "main_grad_or_none",
    "mark_grad_added",
    "overwrites_main_grad",
    "own_dummy_grads",
    "rezeroes_dummy",
    "set_overwrite_main_grad",
    "takes_grad_added_flag",
]

MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes a ``main_grad`` buffer (and so a wgrad GEMM's output) may have."""


class _CachedDummy:
    """One shared zero buffer and its version counter as of its last hand-out."""

    __slots__ = ("buffer", "version")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.version = buffer._version


_DummyKey = tuple[tuple[int, ...], torch.dtype, torch.device, bool]
_dummy_cache: dict[_DummyKey, _CachedDummy] = {}


def is_fsdp_param(param: torch.Tensor) -> bool:
    """Tell whether ``param`` is marked as a Megatron-FSDP parameter (``__fsdp_param__``)."""
    return bool(getattr(param, "__fsdp_param__", False))


@torch.compiler.assume_constant_result
def grad_dtype_of(param: torch.Tensor) -> torch.dtype:
    """Return the dtype autograd gives ``param``'s gradient: its ``grad_dtype``.

    PyTorch's ``Tensor.grad_dtype`` defaults to the parameter's dtype; a bf16
    parameter whose ``grad_dtype`` is fp32 gets fp32 gradients (FSDP2 and
    plain PyTorch use this for fp32 gradients without ``main_grad``). Where it
    is ``None`` (any dtype accepted) or unavailable (a non-leaf tensor, an
    older PyTorch), the parameter's own dtype.

    Under ``torch.compile`` the answer is read once, when the graph is traced
    (set ``grad_dtype`` before the first compiled step).
    """
    dtype = getattr(param, "grad_dtype", None) if param.is_leaf else None
    return dtype if isinstance(dtype, torch.dtype) else param.dtype


def main_grad_or_none(param: torch.Tensor) -> torch.Tensor | None:
    """Return ``param.main_grad`` when it exists and is not ``None``, else ``None``.

    Reads the attribute only; never calls ``get_main_grad()``.
    """
    main_grad = getattr(param, "main_grad", None)
    return main_grad if isinstance(main_grad, torch.Tensor) else None


def fetch_main_grad(param: torch.Tensor, name: str) -> torch.Tensor:
    """Return the buffer the wgrad of ``param`` must be written into.

    On a parameter marked ``__fsdp_param__`` that has ``get_main_grad()``, that
    method is called (exactly once per call of this function; it may hand out a
    fresh, uninitialised buffer). Otherwise ``param.main_grad`` is returned.

    Args:
        param: The parameter.
        name: How error messages name the parameter, e.g. ``"weight3"``.

    Raises:
        RuntimeError: ``param`` has no ``main_grad`` (or it is ``None``).
    """
    if is_fsdp_param(param):
        getter = getattr(param, "get_main_grad", None)
        if callable(getter):
            buffer = getter()
            if not isinstance(buffer, torch.Tensor):
                raise RuntimeError(
                    f"parameter {name!r}: get_main_grad() returned {type(buffer).__name__}, "
                    "expected a torch.Tensor"
                )
            return buffer
    buffer = main_grad_or_none(param)
    if buffer is None:
        given = getattr(param, "main_grad", None)
        if given is not None:
            raise RuntimeError(
                f"parameter {name!r} has main_grad {given!r} ({type(given).__name__}), expected "
                "a torch.Tensor buffer to write its weight gradient into "
                "(accumulate_into_main_grad=True)"
            )
        derived = (
            ""
            if param.is_leaf
            else " (it is computed from another tensor, not a leaf: a parametrization or "
            "weight_norm computes it at each forward; its main_grad would not reach the "
            "parameter it came from, so pass the parameter itself or turn the option off)"
        )
        raise RuntimeError(
            f"parameter {name!r} has no main_grad, but the layer was asked to write its weight "
            "gradient into main_grad (accumulate_into_main_grad=True); give the parameter a "
            f"main_grad buffer or turn the option off{derived}"
        )
    return buffer


def overwrites_main_grad(param: torch.Tensor) -> bool:
    """Return whether the wgrad GEMM must overwrite ``main_grad`` (beta = 0) rather than add."""
    return bool(getattr(param, "overwrite_main_grad", False))


def set_overwrite_main_grad(param: torch.Tensor, overwrite: bool) -> None:
    """Set ``param.overwrite_main_grad``: the next wgrad overwrites (``True``) or adds (``False``).

    For integrations that must correct what a framework set (e.g. Megatron-FSDP
    asks to overwrite where a gradient buffer is not sharded).
    """
    param.overwrite_main_grad = bool(overwrite)  # type: ignore[attr-defined]


def takes_grad_added_flag(param: torch.Tensor) -> bool:
    """Return whether ``param`` carries ``grad_added_to_main_grad`` (and so receives a dummy)."""
    return hasattr(param, "grad_added_to_main_grad")


def mark_grad_added(param: torch.Tensor) -> None:
    """Set ``param.grad_added_to_main_grad = True``."""
    param.grad_added_to_main_grad = True  # type: ignore[attr-defined]


def deliver_to_main_grad(param: torch.Tensor, grad: torch.Tensor, name: str) -> None:
    """Put a finished weight gradient into ``param``'s ``main_grad``, then mark it.

    The one way an implementer (e.g. a reduce-scatter that lands in a
    ``main_grad`` shard) delivers a gradient under the ``main_grad`` contract:
    copied where ``overwrite_main_grad`` is set (old contents, even NaN, are
    never read), else added in ``main_grad``'s dtype; then
    ``grad_added_to_main_grad`` is set ``True`` where the parameter carries it.
    A parameter that does not require grad is left untouched.

    Args:
        param: The parameter (shard) that owns the ``main_grad``.
        grad: Its gradient, of ``main_grad``'s shape, any floating dtype.
        name: How error messages name the parameter.

    Raises:
        RuntimeError: ``param`` has no ``main_grad``, or ``grad``'s shape
            differs from it.
    """
    if not param.requires_grad:
        return
    buffer = fetch_main_grad(param, name)
    if buffer.shape != grad.shape:
        raise RuntimeError(
            f"gradient for {name!r} has shape {tuple(grad.shape)}, expected its main_grad's "
            f"shape {tuple(buffer.shape)}"
        )
    with torch.no_grad():
        if overwrites_main_grad(param):
            buffer.copy_(grad)
        else:
            buffer.add_(grad)
    if takes_grad_added_flag(param):
        mark_grad_added(param)


def rezeroes_dummy(param: torch.Tensor) -> bool:
    """Return whether ``param``'s dummy gradient must be zeroed before each hand-out.

    True where the parameter has a truthy ``zero_out_wgrad`` (the framework
    will add the dummy somewhere).
    """
    return bool(getattr(param, "zero_out_wgrad", False))


def dummy_wgrad(param: torch.Tensor) -> torch.Tensor:
    """Return the zero gradient autograd receives for a parameter whose wgrad went to main_grad.

    The dummy has the parameter's shape, device and grad dtype
    (:func:`grad_dtype_of`, so autograd never casts it) and is a ``.detach()``
    alias of one cached buffer per (shape, dtype, device, truthy ``zero_out_wgrad``),
    so autograd's AccumulateGrad takes it without a copy: parameters handed a dummy
    share ``.grad`` storage (frameworks that honour ``grad_added_to_main_grad``
    ignore ``.grad``); those with ``zero_out_wgrad`` share none with those without,
    whose dummy a write the version counter cannot see would otherwise reach. The
    buffer is allocated zeroed, and zeroed again before this hand-out when
    anything wrote into it since the last one (its version
    counter moved, e.g. a hook or weight decay added into a ``.grad`` alias)
    or when the parameter has a truthy ``zero_out_wgrad``: a dummy is all
    zeros when it is handed out.
    """
    zero_out = rezeroes_dummy(param)
    key = (tuple(param.shape), grad_dtype_of(param), param.device, zero_out)
    cached = _dummy_cache.get(key)
    if cached is None:
        cached = _CachedDummy(torch.zeros(key[0], dtype=key[1], device=key[2]))
        _dummy_cache[key] = cached
    elif zero_out or cached.buffer._version != cached.version:
        cached.buffer.zero_()
        cached.version = cached.buffer._version
    return cached.buffer.detach()


def drop_dummy_grads(params: Iterable[torch.Tensor]) -> None:
    """Set ``.grad = None`` where it is an alias of a dummy (:func:`dummy_wgrad`) autograd
    kept, before this package hands autograd a gradient (or a dummy) for ``params``.

    Such a ``.grad`` shares its storage with every parameter of its shape handed the
    dummy: autograd's ``AccumulateGrad`` adds a later gradient into it in place, so a real
    gradient (the plain route after ``accumulate_into_main_grad`` was switched off, a
    penalty on the weight) would land in all of them. Called before autograd accumulates
    anything of this backward: the dummy it drops held the zeros handed out.
    """
    for param in _dummy_aliased(params):
        param.grad = None


def own_dummy_grads(params: Iterable[torch.Tensor]) -> None:
    """Give each of ``params`` whose ``.grad`` is an alias of a dummy a copy of its own
    (the same values), before a gradient is added into it outside autograd."""
    for param in _dummy_aliased(params):
        param.grad = cast(torch.Tensor, param.grad).clone()


def _dummy_aliased(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``params`` whose ``.grad`` is an alias of a cached dummy buffer (a plain
    tensor: a dummy is one; a wrapper subclass has no data pointer to compare)."""
    if not _dummy_cache:
        return []
    shared = {c.buffer.data_ptr() for c in _dummy_cache.values()} - {0}
    found = []
    for param in params:
        grad = param.grad
        if type(grad) is torch.Tensor and grad.data_ptr() in shared:
            found.append(param)
    return found
