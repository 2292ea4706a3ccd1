"""The FP8 operand rules of the grouped GEMMs, for the one validator (``_validate``).

An FP8 call takes :class:`~groupgrad.kernels._fp8.Fp8Blocks` operands of the
blocks its GEMM reads — ``(1, 128)`` rows and ``(128, 128)`` weights for
fprop/dgrad, ``(128, 1)`` token segments for wgrad — never mixed with
bf16/fp16/fp32 tensors. Their other arguments (``splits``, ``out``) follow
the same rules as every call (``_rules``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from groupgrad.kernels._fp8 import ROWS, SEGMENT_ALIGN, SEGMENTS, WEIGHTS, Block, Fp8Blocks

_FP8_ROLES = {
    ROWS: "x or dy of fprop/dgrad",
    WEIGHTS: "the weights of fprop/dgrad",
    SEGMENTS: "dy and x of wgrad, with splits",
}


def fp8_operand(name: str, value: object, block: Block) -> Fp8Blocks:
    """An :class:`Fp8Blocks` of ``block`` whose tensors have the layout the FP8 GEMMs read.

    ``quantize_fp8`` builds them so; the detailed checks guard a hand-built
    one, whose wrong layout would make a kernel read past its tensors.
    """
    if not isinstance(value, Fp8Blocks):
        raise TypeError(
            f"{name} is a {type(value).__name__}, expected an Fp8Blocks of block {block} "
            f"({_FP8_ROLES[block]}): FP8 operands do not mix with bf16, fp16 or fp32 tensors; "
            "quantize both with quantize_fp8"
        )
    if value.block != block:
        raise ValueError(
            f"{name} is an Fp8Blocks of block {value.block}, expected {block} ({_FP8_ROLES[block]})"
        )
    data, scales = value.data, value.scales
    if data.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise TypeError(
            f"{name} holds {data.dtype} data and {scales.dtype} scales, expected "
            "torch.float8_e4m3fn and torch.float32"
        )
    for part, (shape, strides) in _fp8_layout(value).items():
        t = getattr(value, part)
        if not (  # one combined test per tensor; the message only for a misfit
            isinstance(t, Tensor)
            and t.shape == shape
            and (strides is None or t.stride() == strides or _same_memory(t, strides))
            and t.device == data.device
        ):
            got = (
                "None" if not isinstance(t, Tensor) else f"{tuple(t.shape)} {t.stride()} {t.device}"
            )
            want = f"{shape} with strides {strides}" if strides else f"{shape}"
            raise ValueError(
                f"{name}.{part} is {got}, expected {want} on {data.device} for an Fp8Blocks of "
                f"block {block} and shape {value.shape}; build it with quantize_fp8"
            )
    return value


def _same_memory(t: Tensor, strides: tuple[int, ...]) -> bool:
    """Whether ``t`` is laid out as ``strides`` say where it matters: a dimension of size 1
    has no stride to speak of (a ``(T, 1)`` scale tensor is column- and row-major at once)."""
    return all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), strides, strict=True))


def _fp8_layout(value: Fp8Blocks) -> dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]]:
    """``part -> (shape, strides or None)`` of each tensor of ``value`` (see :class:`Fp8Blocks`)."""
    shape = value.shape
    if value.block == WEIGHTS:
        if len(shape) != 3:
            raise ValueError(
                f"weights is an Fp8Blocks of shape {shape}, expected (E, N, K): quantize an "
                "(E, N, K) tensor or a list of E (N, K) weights"
            )
        E, N, K = shape
        _fp8_multiples("weights", shape, (N, K))
        return {
            "data": ((E, N, K), (N * K, K, 1)),
            "data_t": ((E, K, N), (N * K, N, 1)),
            "scales": ((E, N // 128, K // 128), None),
        }
    if len(shape) != 2:
        raise ValueError(f"an Fp8Blocks of block {value.block} has shape {shape}, expected (T, C)")
    T, C = shape
    _fp8_multiples("the activation", shape, (C,))
    if value.block == ROWS:
        return {"data": ((T, C), (C, 1)), "scales": ((T, C // 128), (1, T))}
    offsets = value.row_offsets
    E = offsets.shape[0] - 1 if isinstance(offsets, Tensor) and offsets.dim() == 1 else -1
    if E < 1:
        raise ValueError(
            f"a (128, 1) Fp8Blocks has row_offsets {offsets!r}, expected (E + 1,) offsets"
        )
    padded = -(-(T + (SEGMENT_ALIGN - 1) * E) // SEGMENT_ALIGN) * SEGMENT_ALIGN
    blocks = -(-T // 128) + E
    return {
        "data": ((C, padded), (padded, 1)),
        "scales": ((blocks, C), (C, 1)),
        **dict.fromkeys(("row_offsets", "seg_offsets", "block_offsets"), ((E + 1,), None)),
    }


def _fp8_multiples(what: str, shape: tuple[int, ...], dims: tuple[int, ...]) -> None:
    if any(d % 128 for d in dims):
        raise ValueError(f"{what} has shape {shape}, expected K and N multiples of 128 for FP8")


def fp8_splits_agree(name: str, value: Fp8Blocks, splits_E: Tensor, given: object) -> None:
    """``value`` was quantized for the experts of ``splits_E``: the same count, and the same
    token counts where both are on the host (a device tensor is never read).

    ``given`` is the call's ``splits`` as the caller passed it: the very object
    ``value`` was quantized with agrees without a look.
    """
    if value.splits is given:
        return
    E = splits_E.shape[0]
    if value.row_offsets is not None and value.row_offsets.shape[0] - 1 != E:
        raise ValueError(
            f"{name} was quantized for {value.row_offsets.shape[0] - 1} experts but splits has "
            f"{E} entries"
        )
    own = value.splits
    host = not isinstance(own, Tensor) or own.device.type == "cpu"
    if host and splits_E.device.type == "cpu" and not torch.compiler.is_compiling():
        own_counts = own.tolist() if isinstance(own, Tensor) else [int(n) for n in own or ()]
        if own_counts != splits_E.tolist():
            raise ValueError(
                f"{name} was quantized with splits {own_counts} but splits is "
                f"{splits_E.tolist()}: its 128-token blocks would straddle experts"
            )
