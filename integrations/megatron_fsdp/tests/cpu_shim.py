"""Test-only shim that lets the real ``megatron_fsdp`` 0.6 package run on CPU with gloo.

Installed by the worker processes of the CPU tests only (never by library code,
never when CUDA is available). What it patches, and why:

* ``torch.cuda.Stream``, ``torch.cuda.Event``, ``torch.cuda.stream``,
  ``torch.cuda.current_stream``: Megatron-FSDP creates side streams for its
  all-gather / reduce-scatter pipelines and runs collectives under
  ``torch.cuda.stream(...)``. Here every collective completes before its call
  returns (``async_op`` and coalesced ones too, also those of
  ``megatron_fsdp.param_and_grad_buffer``), so everything runs in program
  order and a stream that does nothing (and a context that does nothing) is
  exact.
* ``torch.cuda.current_device`` (returns 0), ``torch.cuda.synchronize``,
  ``torch.cuda.empty_cache`` (no-ops): called unconditionally while building
  buffers and when finishing gradient synchronisation.
* ``torch.Tensor.cuda`` (returns the tensor itself): the uneven-DTensor
  boundary check (``megatron_fsdp.uneven_dtensor.validate_uneven_dtensor``)
  moves a small int tensor to CUDA before a gloo all-reduce.

Not a CUDA call, but gloo-specific: gloo has no ``PREMUL_SUM`` reduce op, which
Megatron-FSDP uses to fuse the ``1/world`` gradient scaling into the
reduce-scatter. :func:`use_unfused_grad_scaling` sets Megatron-FSDP's own
``ddp_config.gradient_reduce_div_fusion = False`` so it scales first and
reduces with ``SUM`` (same result).
"""

from __future__ import annotations

from typing import Any

import torch

from groupgrad_testsupport.cpu_streams import collectives_in_program_order, stub_streams


def install() -> None:
    """Patch the CUDA calls listed in the module docstring; refuses when CUDA is available."""
    if torch.cuda.is_available():
        raise RuntimeError("cpu_shim is for CPU-only test processes; CUDA is available here")
    stub_streams()
    import megatron_fsdp.param_and_grad_buffer as buffers  # imported _coalescing_manager by name

    collectives_in_program_order(buffers)
    torch.cuda.current_device = lambda: 0
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def use_unfused_grad_scaling(model: Any) -> None:
    """Make a ``MegatronFSDP`` model reduce with ``SUM`` after scaling (gloo has no PREMUL_SUM)."""
    model.ddp_config.gradient_reduce_div_fusion = False
