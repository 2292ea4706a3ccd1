"""The validated forms of the grouped GEMM calls, and the dtypes they take.

``_validate`` builds a :class:`GroupedCall` (fprop, dgrad) or a
:class:`WgradCall` from the public functions' arguments, or raises; so does
``_lean`` for the common call. The custom-op layer (``_ops``) and the
reference (``_reference``) consume their fields.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from groupgrad.kernels._listed import ListedFacts

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WGRAD_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GroupedCall:
    """A validated fprop (``y_e = x_e @ w_e.T``) or dgrad (``dx_e = dy_e @ w_e``) call.

    ``a`` is ``x_TK`` for fprop and ``dy_TN`` for dgrad; ``out`` is ``y_TN``
    or ``dx_TK``; ``weights`` is in op-argument form (see ``_grouped``);
    ``splits`` is ``splits_E``, an int32/int64 tensor on the CPU or ``a``'s
    device; ``listed`` holds what one pass over listed weights found
    (``_listed``; ``None`` for packed weights).
    """

    a: Tensor
    weights: list[Tensor]
    splits: Tensor
    out: Tensor
    listed: ListedFacts | None = None


@dataclass(frozen=True)
class WgradCall:
    """A validated wgrad call: ``dw_e = dy_e.T @ x_e`` written into ``out``.

    ``dy`` is ``dy_TN``, ``x`` is ``x_TK``, ``splits`` is ``splits_E``;
    ``out`` is in op-argument form (``[dw_ENK]`` or ``E`` matrices);
    ``result`` is what the public function returns (the caller's ``out``
    object, or the freshly allocated ``(E, N, K)`` tensor); ``listed`` holds
    what one pass over listed outputs found (``_listed``; ``None`` otherwise).
    """

    dy: Tensor
    x: Tensor
    splits: Tensor
    out: list[Tensor]
    accumulate: bool
    result: Tensor | Sequence[Tensor]
    listed: ListedFacts | None = None
