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
==========================  =================================================
"""

from __future__ import annotations

import torch

__all__ = [
    "dummy_wgrad",
    "fetch_main_grad",
    "is_fsdp_param",
    "main_grad_or_none",
    "mark_grad_added",
    "overwrites_main_grad",
    "rezeroes_dummy",
    "takes_grad_added_flag",
]

_DummyKey = tuple[tuple[int, ...], torch.dtype, torch.device]
_dummy_cache: dict[_DummyKey, torch.Tensor] = {}


def is_fsdp_param(param: torch.Tensor) -> bool:
    """Tell whether ``param`` is marked as a Megatron-FSDP parameter (``__fsdp_param__``)."""
    return bool(getattr(param, "__fsdp_param__", False))


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
        raise RuntimeError(
            f"parameter {name!r} has no main_grad, but the layer was asked to write its weight "
            "gradient into main_grad (accumulate_into_main_grad=True); give the parameter a "
            "main_grad buffer or turn the option off"
        )
    return buffer


def overwrites_main_grad(param: torch.Tensor) -> bool:
    """Return whether the wgrad GEMM must overwrite ``main_grad`` (beta = 0) rather than add."""
    return bool(getattr(param, "overwrite_main_grad", False))


def takes_grad_added_flag(param: torch.Tensor) -> bool:
    """Return whether ``param`` carries ``grad_added_to_main_grad`` (and so receives a dummy)."""
    return hasattr(param, "grad_added_to_main_grad")


def mark_grad_added(param: torch.Tensor) -> None:
    """Set ``param.grad_added_to_main_grad = True``."""
    param.grad_added_to_main_grad = True  # type: ignore[attr-defined]


def rezeroes_dummy(param: torch.Tensor) -> bool:
    """Return whether ``param``'s dummy gradient must be zeroed before each hand-out.

    True where the parameter has a truthy ``zero_out_wgrad`` (the framework
    will add the dummy somewhere).
    """
    return bool(getattr(param, "zero_out_wgrad", False))


def dummy_wgrad(param: torch.Tensor) -> torch.Tensor:
    """Return the zero gradient autograd receives for a parameter whose wgrad went to main_grad.

    The dummy has the parameter's shape, dtype and device and is a
    ``.detach()`` alias of a cached buffer, so autograd's AccumulateGrad can
    take it without a copy. The buffer is allocated zeroed; when the parameter
    has a truthy ``zero_out_wgrad`` (the framework will add the dummy
    somewhere), it is zeroed again before this hand-out.
    """
    key = (tuple(param.shape), param.dtype, param.device)
    cached = _dummy_cache.get(key)
    if cached is None:
        cached = torch.zeros(key[0], dtype=param.dtype, device=param.device)
        _dummy_cache[key] = cached
    elif rezeroes_dummy(param):
        cached.zero_()
    return cached.detach()
