"""FP8 (e4m3) blockwise quantization for Hopper's FP8 GEMMs: ``quantize_fp8`` and ``Fp8Blocks``.

Legend: ``T`` tokens, ``C`` channels, ``E`` experts, ``N``/``K`` a weight's
rows/columns, ``NB`` the 128-token blocks and ``Tp`` the padded tokens of the
``(128, 1)`` form (see :class:`Fp8Blocks`). The arguments are checked here;
the math (one scale rule, the reference, the custom ops that run Triton on
CUDA) lives in ``_fp8_ops``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from groupgrad.kernels import _fp8_ops, _rules
from groupgrad.kernels._fp8_ops import SEGMENT_ALIGN, segment_offsets, token_map
from groupgrad.kernels._group import PLAIN_TYPES, listed_facts

__all__ = ["Fp8Blocks", "check_splits", "quantize_fp8", "quantize_fp8_ref", "segment_offsets"]

ROWS, WEIGHTS, SEGMENTS = (1, 128), (128, 128), (128, 1)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

Splits = Sequence[int] | Tensor
Block = tuple[int, int]
_SEALABLE = {*PLAIN_TYPES, type(None)}


def _state(form: Fp8Blocks) -> list[Any]:
    """What a seal remembers of ``form``: its block and shape, and of each tensor a GEMM reads
    (``data``, ``data_t``, ``scales``, ``row_offsets``: the GEMMs derive a ``(128, 1)``
    form's other offsets from its token counts, as its quantizer did) the address, shape,
    strides and dtype (another tensor in its place, ``.data =``, ``resize_``, ``t_`` or
    ``set_`` change them; values do not), and last the version of ``row_offsets`` (the
    counts the data was cut by: :meth:`Fp8Blocks._seal_holds` refuses their in-place edit)."""
    state: list[Any] = [form.block, form.shape]
    for t in (form.data, form.data_t, form.scales, form.row_offsets):
        if t is not None:
            state += (t.data_ptr(), t.shape, t.stride(), t.dtype)
    offsets = form.row_offsets  # an inference tensor keeps no version
    return [*state, None if offsets is None or torch.is_inference(offsets) else offsets._version]


class Fp8Blocks:
    """FP8 e4m3 data and fp32 block scales of one tensor, in the layout its FP8 GEMM reads.

    Built by :func:`quantize_fp8`; plain Python around tensors, so compiled
    code builds it from custom-op outputs, and custom ops take it apart with
    :meth:`tensors` and :meth:`from_tensors`. Layouts by ``block``:

    * ``(1, 128)``: ``data`` ``(T, C)`` row-major; ``scales`` ``(T, C/128)``
      with strides ``(1, T)`` (column-major, as cuBLASLt's 1×128 scaling wants).
    * ``(128, 128)``: ``data`` ``(E, N, K)`` and ``data_t`` ``(E, K, N)``
      contiguous (``(N, K)``/``(K, N)`` for a 2-D source), ``scales``
      ``(E, N/128, K/128)``.
    * ``(128, 1)``: ``data`` ``(C, Tp)`` row-major, token-contiguous, expert
      ``e``'s tokens at columns ``[seg_offsets[e], seg_offsets[e] + splits[e])``
      (16-aligned starts, ``Tp = round_up(T + 15 E, 16)``, zero padding);
      ``scales`` ``(NB, C)`` with ``NB = ceil(T/128) + E``, expert ``e``'s
      128-token blocks at rows ``[block_offsets[e], block_offsets[e+1])``
      (its last block may be shorter), unused rows zero.

    Args:
        data: the e4m3 data.
        scales: the fp32 scales (NaN for a block holding NaN or Inf).
        block: ``(1, 128)``, ``(128, 128)`` or ``(128, 1)``.
        dtype: the source's dtype.
        shape: the source's shape (``(E, N, K)`` for a list of weights).
        data_t: the transposed data of a ``(128, 128)`` form, else ``None``.
        splits: the ``(128, 1)`` form's ``splits`` as given, else ``None``.
        row_offsets, seg_offsets, block_offsets: ``(E + 1,)`` int64 on the
            data's device for ``(128, 1)`` (each expert's first source row,
            data column, scale row), else ``None``.
        listed: the source was a list of weights.

    Returns:
        A new ``Fp8Blocks`` holding the tensors as given (nothing is copied).

    Attributes:
        data, data_t, scales, block, dtype, shape, splits, row_offsets,
        seg_offsets, block_offsets, listed: as above.
    """

    def __init__(
        self,
        data: Tensor,
        scales: Tensor,
        *,
        block: tuple[int, int],
        dtype: torch.dtype,
        shape: tuple[int, ...],
        data_t: Tensor | None = None,
        splits: Sequence[int] | Tensor | None = None,
        row_offsets: Tensor | None = None,
        seg_offsets: Tensor | None = None,
        block_offsets: Tensor | None = None,
        listed: bool = False,
    ) -> None:
        self.data, self.data_t, self.scales = data, data_t, scales
        self.block, self.dtype, self.shape = tuple(block), dtype, tuple(shape)
        self.row_offsets, self.seg_offsets = row_offsets, seg_offsets
        self.block_offsets, self.splits, self.listed = block_offsets, splits, listed
        self._seal: list[Any] | None = None

    def _sealed(self, *, checked: bool = False) -> Fp8Blocks:
        """This form, sealed: its tensors are in the layout of ``block`` and ``shape`` (built so
        by the quantizer, or found so by ``_validate.fp8_operand``) until one is replaced or
        given other memory, shape, strides or dtype (:func:`_state`). Not compiled. The
        seal's other entries: the GEMMs' shape rules were found to hold (``checked``), and
        whether the CUDA kernels may read its tensors where they lie (:meth:`_placed`,
        found when first asked)."""
        if torch.compiler.is_compiling():
            return self
        tensors = self.tensors()  # plain ones only: a fake tensor has no address to remember
        if set(map(type, tensors)) <= _SEALABLE:
            self._seal = [_state(self), checked, None]
        else:
            self._seal = None
        return self

    def _placed(self, find: Callable[[Fp8Blocks], bool]) -> bool:
        """Whether the CUDA kernels may read this form's tensors where they lie: ``find``'s
        answer (``_fp8_gemm.placed_for_kernels``), kept by the seal (its tensors keep their
        addresses and shapes while it holds), so found once per seal; ``False`` without
        one. Asked of a form the validator just passed, which renews a seal that no longer
        holds."""
        seal = self._seal
        if seal is None:
            return False
        if seal[2] is None:
            seal[2] = find(self)
        return cast(bool, seal[2])

    def _seal_holds(self, name: str) -> list[Any] | None:
        """The seal :meth:`_sealed` recorded while it holds (the same block, shape and tensor
        states), else ``None``.

        Raises:
            ValueError: Only ``row_offsets``' version moved: the counts the data was cut by
                were written in place (``name``: how the message names the form).
        """
        seal = self._seal
        if seal is None or torch.compiler.is_compiling():
            return None
        state = _state(self)
        if seal[0][:-1] == state[:-1] and seal[0][-1] != state[-1]:
            raise ValueError(
                f"{name}.row_offsets was written in place since {name} was built or checked "
                f"(version {seal[0][-1]}, now {state[-1]}): its data was cut by the counts it "
                "held then; quantize the tensor again"
            )
        return seal if seal[0] == state else None

    def tensors(self) -> tuple[Tensor | None, ...]:
        """The tensors, to pass into a custom op: ``(data, data_t, scales, row_offsets,
        seg_offsets, block_offsets)``, ``None`` where the form has none (:meth:`from_tensors`
        takes it back)."""
        offsets = self.row_offsets, self.seg_offsets, self.block_offsets
        return self.data, self.data_t, self.scales, *offsets

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor | None], **meta: Any) -> Fp8Blocks:
        """Rebuild from :meth:`tensors`' tuple and the static fields.

        Args:
            tensors: ``(data, data_t, scales, row_offsets, seg_offsets, block_offsets)``.
            **meta: ``block``, ``dtype``, ``shape`` and, as they apply, ``splits``, ``listed``.

        Returns:
            A new ``Fp8Blocks`` over the same tensors.
        """
        data, data_t, scales, row_offsets, seg_offsets, block_offsets = tensors
        if data is None or scales is None:
            raise ValueError("tensors holds no data or no scales, expected both")
        offsets: dict[str, Any] = {"row_offsets": row_offsets, "seg_offsets": seg_offsets}
        return cls(data, scales, data_t=data_t, block_offsets=block_offsets, **offsets, **meta)

    def dequantize(self) -> Tensor | list[Tensor]:
        """``data * scale`` per block, in fp32, in the source's shape and row order.

        Returns:
            A new fp32 tensor of ``shape`` (a list of ``E`` ``(N, K)`` tensors
            when the source was a list); a NaN/Inf block comes back all NaN, and
            so does all of a ``(128, 1)`` form whose device ``splits`` were
            malformed (negative, or not summing to ``T``).
        """
        if self.block == ROWS:
            T, C = self.shape
            blocks = self.data.float().view(T, C // 128, 128) * self.scales[:, :, None]
            return blocks.view(T, C)
        if self.block == WEIGHTS:
            *_, N, K = self.shape
            E = self.data.shape[0] if self.data.dim() == 3 else 1
            data, scales = self.data.float().reshape(E, N // 128, 128, K // 128, 128), self.scales
            out = (data * scales.reshape(E, N // 128, 1, K // 128, 1)).reshape(E, N, K)
            return list(out.unbind(0)) if self.listed else out.reshape(self.shape)
        offsets = (self.row_offsets, self.seg_offsets, self.block_offsets)
        if not all(isinstance(o, Tensor) for o in offsets):
            raise ValueError("a (128, 1) Fp8Blocks needs row_offsets, seg_offsets, block_offsets")
        where = token_map(*offsets, self.shape[0])  # type: ignore[arg-type]
        out = self.data[:, where.column].float().t() * self.scales[where.block_row]
        return out.masked_fill_(where.malformed, float("nan"))  # malformed device splits

    def __repr__(self) -> str:
        sizes = f"data={tuple(self.data.shape)}, scales={tuple(self.scales.shape)}"
        return f"Fp8Blocks(block={self.block}, shape={self.shape}, dtype={self.dtype}, {sizes})"


# ---------------------------------------------------------------- argument checks


class _Impl(NamedTuple):
    """One implementation of the three quantizers: the custom ops (whose entry points run
    their kernels directly in plain eager code, ``_fp8_ops``), or the reference."""

    rows: Callable[..., tuple[Tensor, Tensor]]
    weights: Callable[..., tuple[Tensor, Tensor, Tensor]]
    segments: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]


OPS = _Impl(_fp8_ops.rows, _fp8_ops.weights, _fp8_ops.segments)
REFERENCE = _Impl(_fp8_ops.rows_ref, _fp8_ops.weights_ref, _fp8_ops.segments_ref)


def _as_block(b: object) -> Block | None:
    """``b`` as one of the three block shapes, or ``None``."""
    if isinstance(b, tuple | list) and len(b) == 2:
        return next((known for known in (ROWS, WEIGHTS, SEGMENTS) if tuple(b) == known), None)
    return None


def _blocks_of(block: object) -> tuple[list[Block], bool]:
    """The blocks asked for, and whether they were asked as a tuple of blocks."""
    single = _as_block(block)
    if single is not None:
        return [single], False
    if isinstance(block, tuple | list) and block:
        blocks = [b for b in map(_as_block, block) if b is not None]
        if len(blocks) == len(block) and (len(blocks) == 1 or sorted(blocks) == [ROWS, SEGMENTS]):
            return blocks, True
    raise ValueError(
        f"block is {block!r}, expected (1, 128), (128, 128) or (128, 1), or the tuple "
        "((1, 128), (128, 1)) (both forms in one call)"
    )


def _check_tensor(t: object, name: str) -> Tensor:
    x = _rules.tensor_arg(name, t)  # a dense tensor
    _rules.check_unrecorded("quantize_fp8", [(name, x)], None)
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}, expected {_rules.DTYPE_CHOICES}")
    return x


def check_splits(splits: object, T: int, device: torch.device, rows: str = "t") -> Splits:
    """``splits`` checked by the GEMMs' rule (``_rules.splits_arg``: a device tensor's values
    are never read): a tensor as given, any other form as its ints (not read back from a
    tensor: data-dependent under torch.compile). ``rows``: the argument it counts rows of."""
    _rules.splits_arg(splits, rows, T, device, experts=None)
    if isinstance(splits, Tensor):
        return splits
    return [operator.index(s) for s in cast("Sequence[Any]", splits)]


# ---------------------------------------------------------------- the three forms


def _member(w: object, i: int, first: Tensor) -> Tensor:
    """Listed weight ``t[i]``, checked against ``t[0]``."""
    member = _check_tensor(w, f"t[{i}]")
    if member.dtype != first.dtype:
        raise TypeError(f"t[{i}] has dtype {member.dtype}, expected {first.dtype} like t[0]")
    if member.shape != first.shape or member.device != first.device:
        raise ValueError(
            f"t[{i}] is {tuple(member.shape)} on {member.device}, expected "
            f"{tuple(first.shape)} on {first.device} like t[0]"
        )
    return member


def _activation(t: object, block: Block) -> Tensor:
    x = _check_tensor(t, "t")
    if x.dim() != 2:
        raise ValueError(f"t has shape {tuple(x.shape)}, expected (T, C) for block {block}")
    if x.shape[1] % 128:
        raise ValueError(f"t's last dimension is {x.shape[1]}, expected a multiple of 128")
    return x.contiguous()


def _weights(t: object, impl: _Impl) -> Fp8Blocks:
    listed = isinstance(t, list | tuple)
    members = list(t) if isinstance(t, list | tuple) else [t]
    if not members:
        raise ValueError("t is an empty list, expected E (N, K) weights")
    name = "t[0]" if listed else "t"
    first = _check_tensor(members[0], name)
    if first.dim() not in ((2,) if listed else (2, 3)):
        want = "(N, K)" if listed else "(E, N, K) or (N, K)"
        raise ValueError(f"{name} has shape {tuple(first.shape)}, expected {want}")
    N, K = first.shape[-2:]
    if N % 128 or K % 128:
        raise ValueError(
            f"{name} has shape {tuple(first.shape)}, expected N and K multiples of 128"
        )
    if not listed:
        group = [(first if first.dim() == 3 else first[None]).contiguous()]
    elif (facts := listed_facts(members, first)).alike:  # one pass, not one by one
        group = cast("list[Tensor]", members)
        _rules.check_unrecorded("quantize_fp8", [("t", group)], facts)
    else:
        group = [_member(w, i, first).contiguous() for i, w in enumerate(members)]
    data, data_t, scales = impl.weights(group)
    if first.dim() == 2 and not listed:
        data, data_t, scales = data[0], data_t[0], scales[0]
    shape = (len(members), N, K) if listed else tuple(first.shape)
    return Fp8Blocks(
        data, scales, block=WEIGHTS, dtype=first.dtype, shape=shape, data_t=data_t, listed=listed
    )


def _tokens(x: Tensor, splits: Splits, with_rows: bool, impl: _Impl) -> dict[Block, Fp8Blocks]:
    counts = check_splits(splits, x.shape[0], x.device)
    T, E = x.shape[0], len(counts)
    row, seg, block = segment_offsets(counts, x.device, fused=impl is OPS)
    num_blocks = -(-T // 128) + E
    padded = -(-(T + (SEGMENT_ALIGN - 1) * E) // SEGMENT_ALIGN) * SEGMENT_ALIGN
    data, scales, row_data, row_scales = impl.segments(
        x, row, seg, block, num_blocks, padded, with_rows
    )
    meta: dict[str, Any] = {"dtype": x.dtype, "shape": tuple(x.shape)}
    found = {
        SEGMENTS: Fp8Blocks(
            data, scales, block=SEGMENTS, splits=splits, row_offsets=row, seg_offsets=seg,
            block_offsets=block, **meta,
        )
    }  # fmt: skip
    if with_rows:
        found[ROWS] = Fp8Blocks(row_data, row_scales.t(), block=ROWS, **meta)
    return found


def _quantize(
    t: Tensor | Sequence[Tensor], block: object, splits: Splits | None, impl: _Impl
) -> Fp8Blocks | tuple[Fp8Blocks, ...]:
    blocks, many = _blocks_of(block)
    if SEGMENTS in blocks and splits is None:
        raise ValueError("block (128, 1) needs splits, the token count of each expert")
    if SEGMENTS not in blocks and splits is not None:
        raise ValueError(f"splits is only for block (128, 1), got block={block!r}")
    if blocks == [WEIGHTS]:
        found = {WEIGHTS: _weights(t, impl)}
    else:
        x = _activation(t, blocks[0])
        if splits is not None:
            found = _tokens(x, splits, ROWS in blocks, impl)
        else:
            data, scales = impl.rows(x)
            found = {ROWS: Fp8Blocks(data, scales.t(), block=ROWS, dtype=x.dtype, shape=x.shape)}
    for form in found.values():
        form._sealed()  # built in its block's layout: the validator checks its tensors no more
    return tuple(found[b] for b in blocks) if many else found[blocks[0]]


# ---------------------------------------------------------------- public entry points


def quantize_fp8(
    t: Tensor | Sequence[Tensor], *, block: Any, splits: Splits | None = None
) -> Fp8Blocks | tuple[Fp8Blocks, ...]:
    """Quantize ``t`` to FP8 e4m3 with one fp32 scale per block (Hopper's blockwise recipe).

    Blocks (each gets its own power-of-two scale, the smallest at or above
    ``amax / 448``; :class:`Fp8Blocks` gives the layouts):

    * ``(1, 128)``: 128 channels of each row of a ``(T, C)`` activation
      (``x``, ``dy`` for fprop/dgrad).
    * ``(128, 128)``: 128×128 tiles of weights, ``(E, N, K)``, ``(N, K)`` or a
      list of ``E`` ``(N, K)`` tensors (one quantized weight serves fprop and
      dgrad: ``data`` and ``data_t``).
    * ``(128, 1)`` with ``splits``: 128 tokens × 1 channel inside each
      expert's segment of a ``(T, C)`` activation, never straddling two
      experts (the wgrad operands); callers never pad token counts.
    * ``((1, 128), (128, 1))`` (either order) with ``splits``: both forms,
      each from ``t`` itself, as a tuple in the order asked.

    e4m3 data is ``x / scale`` rounded to nearest even (saturating at ±448);
    a zero block gets scale 1 and zero data, a block holding NaN or Inf gets
    scale NaN (it dequantizes to NaN). On CUDA Triton kernels run (on sm_90 one
    CUDA kernel of the CUTLASS extension, built on first use, makes a bf16 or
    fp16 activation's token forms; the reference without triton or before
    sm_89, said once through :mod:`logging`), bit-identical to
    :func:`quantize_fp8_ref`; elsewhere the reference. As custom ops
    (``groupgrad::quantize_fp8_*``) ``torch.compile(fullgraph=True)`` and CUDA
    graphs see it. Nothing is mutated.

    Args:
        t: the tensor to quantize, bf16, fp16 or fp32 (any strides), or for
            ``(128, 128)`` a list/tuple of ``(N, K)`` tensors (one dtype,
            shape and device; need not be adjacent in memory). ``C``, ``N``
            and ``K`` are multiples of 128.
        block: a block shape above, or the tuple of two.
        splits: ``(128, 1)`` only: ``E`` token counts (``>= 0``, summing to
            ``T``; zeros allowed) as a list/tuple of ints, a CPU tensor, or an
            int32/int64 tensor on ``t``'s device, whose values are never read
            on the host (no sync; capturable in a CUDA graph). A list is
            copied to the device, so pass a device tensor under capture.

    Returns:
        An :class:`Fp8Blocks` (a tuple of them for a tuple of blocks), its
        tensors new and on ``t``'s device.

    Raises:
        TypeError: ``t`` or a member is not a bf16/fp16/fp32 tensor, or
            ``splits`` is not a list of ints or an int32/int64 tensor.
        ValueError: an unknown ``block``; shapes not multiples of 128;
            ``splits`` missing for ``(128, 1)`` or given for another block,
            negative, or (list or CPU tensor) not summing to ``T``.
    """
    return _quantize(t, block, splits, OPS)


def quantize_fp8_ref(
    t: Tensor | Sequence[Tensor], *, block: Any, splits: Splits | None = None
) -> Fp8Blocks | tuple[Fp8Blocks, ...]:
    """Pure-PyTorch twin of :func:`quantize_fp8`: same arguments, bit-identical results.

    Runs on any device in fp32 math, without the custom ops; a device
    ``splits`` is used on the device, never read on the host. Nothing is
    mutated.

    Args:
        t: as for :func:`quantize_fp8`.
        block: as for :func:`quantize_fp8`.
        splits: as for :func:`quantize_fp8`.

    Returns:
        An :class:`Fp8Blocks`, or a tuple of them for a tuple of blocks.
    """
    return _quantize(t, block, splits, REFERENCE)
