"""Which compiled CUTLASS kernel runs a call: :class:`Plan` and :func:`plan_for`.

Public through ``groupgrad.kernels.tuning``. Pure Python over shapes and
dtypes: nothing here loads the extension or touches CUDA. The heuristic and
the measurements behind it are in ``kernels/NOTES.md``.

Legend: ``T`` tokens, ``E`` groups (experts), ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from groupgrad.kernels.build import COOP_TILE, PONG_TILE, Variant

_DTYPE_TAGS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}

#: Tokens per group (T / E) from which :func:`plan_for` takes the ping-pong tile.
LARGE_GROUP_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which compiled variant runs a call, and the persistent scheduler's raster order.

    Attributes:
        variant: name of a compiled :class:`~groupgrad.kernels.build.Variant`
            (``Variant.name``), e.g. ``"fprop_bf16_bf16_coop_128x256x64_c1x1"``.
        raster_along_n: walk output tiles along ``N`` first (default: along ``M``).
        max_swizzle: the tile scheduler's swizzle width: 1, 2, 4 or 8.
    """

    variant: str
    raster_along_n: bool = False
    max_swizzle: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.variant, str):
            raise TypeError(f"variant must be a str, got {type(self.variant).__name__}")
        if not isinstance(self.raster_along_n, bool):
            raise TypeError(
                f"raster_along_n must be a bool, got {type(self.raster_along_n).__name__}"
            )
        swizzle = self.max_swizzle
        if type(swizzle) is not int or swizzle not in (1, 2, 4, 8):
            raise ValueError(f"max_swizzle is {self.max_swizzle!r}, expected 1, 2, 4 or 8")


def plan_for(
    op: str,
    dtype_in: torch.dtype,
    dtype_out: torch.dtype,
    T: int,
    E: int,
    N: int,
    K: int,
) -> Plan:
    """Choose the kernel of one call (the heuristic of ``kernels/NOTES.md``).

    The GEMM of one group is ``M x N' x K'``: fprop ``(T/E) x N x K``, dgrad
    ``(T/E) x K x N``, wgrad ``N x K x (T/E)`` (ragged dimension on average).
    Groups of at least :data:`LARGE_GROUP_ROWS` tokens on average take the
    ping-pong 128x128 tile with a 1x2 cluster, smaller ones the cooperative
    128x256 tile; dgrad with ``N >= 4 K`` stays cooperative.

    Args:
        op: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``.
        dtype_in: dtype of the inputs, ``torch.bfloat16`` or ``torch.float16``.
        dtype_out: dtype of the output (wgrad: also ``torch.float32``).
        T: tokens (rows of ``x`` / ``dy``).
        E: groups (experts).
        N: out_features.
        K: in_features.

    Returns:
        The :class:`Plan` (default raster order and swizzle).
    """
    rows = T / max(E, 1)
    large = rows >= LARGE_GROUP_ROWS and not (op == "dgrad" and N >= 4 * K)
    return _plan(op, _DTYPE_TAGS[dtype_in], _DTYPE_TAGS[dtype_out], large)


@functools.cache
def _plan(op: str, dtype_in: str, dtype_out: str, large: bool) -> Plan:
    # Large groups: ping-pong 128x128 (one warp group's epilogue overlaps the other's
    # mainloop) with a 1x2 cluster, so no M tile is padded to a cluster pair. Many small
    # groups: cooperative 128x256 without a cluster. Exception, measured: dgrad with a
    # reduction (N) much longer than its output rows (K) runs better cooperative
    # (E=8, K=4096, N=28672, skewed splits).
    sched, tile, cluster = PONG_TILE if large else COOP_TILE
    return Plan(Variant(op, dtype_in, dtype_out, sched, tile, cluster).name)
