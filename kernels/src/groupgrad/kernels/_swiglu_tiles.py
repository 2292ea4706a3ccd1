"""Tile shape of the Triton SwiGLU kernels, chosen without importing triton.

Legend: ``T`` tokens, ``F`` ffn_hidden_size. A program of the forward kernel
covers a ``(BLOCK_T, BLOCK_F)`` tile of ``a_TF``; the backward kernel walks
``F`` in ``BLOCK_F``-wide chunks for ``BLOCK_T`` rows. Kept apart from
``_swiglu_triton`` (which needs triton at import) so the choice is testable
everywhere.
"""

from __future__ import annotations

TILE_ELEMENTS = 2048  # elements per program per step: 16 per thread at 4 warps
MAX_BLOCK_F = 512
MIN_EXACT_BLOCK_F = 64  # narrower exact divisors are not worth it: cover F instead


def _next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length()


def block_f(F: int) -> int:
    """Columns per tile: the largest power of two up to 512 that tiles ``F`` exactly.

    A ragged last block wastes its masked lanes: F = 768 in 512-wide blocks
    leaves a quarter of the lanes idle (and ran at 1.8 TB/s on the H200).
    Without such a divisor (>= 64), the smallest power of two covering ``F``,
    capped at 512.

    Args:
        F: ffn_hidden_size, the number of activation columns (``>= 0``).

    Returns:
        ``BLOCK_F``, a power of two between 1 and 512.
    """
    widest = min(_next_power_of_2(max(F, 1)), MAX_BLOCK_F)
    block = widest
    while block >= MIN_EXACT_BLOCK_F:
        if F % block == 0:
            return block
        block //= 2
    return widest


def tile(F: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_F)`` for ``F`` columns: :func:`block_f` wide, 2048 elements in all."""
    columns = block_f(F)
    return max(1, TILE_ELEMENTS // columns), columns
