"""The ``torch.library`` custom ops ``groupgrad::grouped_{fprop,dgrad,wgrad}``.

Each op writes into its ``out`` argument (declared in ``mutates_args``) and
returns nothing. The default kernel, used on every device but CUDA, is the
pure-PyTorch reference; the CUDA kernel (``_dispatch``) runs CUTLASS or falls
back to the reference. The fake kernels do nothing — the output already
exists — so ``torch.compile`` traces a call without running it. Arguments
arrive validated by the public functions; groups of matrices travel in the
form described in ``_grouped``; ``splits`` is an int32/int64 tensor on the CPU
or the operands' device.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import torch
from torch import Tensor

from groupgrad.kernels import _dispatch, _reference, _splits
from groupgrad.kernels._grouped import per_expert


@torch.library.custom_op("groupgrad::grouped_fprop", mutates_args=("out",))
def grouped_fprop_op(x: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """Reference kernel: ``y_e = x_e @ w_e.T``; ``x`` (T, K), ``out`` (T, N)."""
    host_splits = _splits.host_values(splits, x.shape[0], "x")
    _reference.fprop(x, per_expert(weights), host_splits, out)


@torch.library.custom_op("groupgrad::grouped_dgrad", mutates_args=("out",))
def grouped_dgrad_op(dy: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """Reference kernel: ``dx_e = dy_e @ w_e``; ``dy`` (T, N), ``out`` (T, K)."""
    host_splits = _splits.host_values(splits, dy.shape[0], "dy")
    _reference.dgrad(dy, per_expert(weights), host_splits, out)


@torch.library.custom_op("groupgrad::grouped_wgrad", mutates_args=("out",))
def grouped_wgrad_op(
    dy: Tensor, x: Tensor, splits: Tensor, out: list[Tensor], accumulate: bool
) -> None:
    """Reference kernel: ``dw_e = dy_e.T @ x_e``, added to or written into ``out``."""
    host_splits = _splits.host_values(splits, x.shape[0], "x")
    _reference.wgrad(dy, x, host_splits, per_expert(out), accumulate)


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
