"""The argument rules of the grouped GEMMs, each written once, for the one validator.

Each rule has one form: one combined cheap test that accepts the common
case (plain contiguous tensors on one device, a packed group, integer
``splits``) and, only when that test fails, the checks that name the misfit
— the argument as the caller named it (``names``), its value and what was
expected. ``_validate`` puts them together per entry point; nothing else
calls them.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from typing import Any, TypeGuard, cast

import torch
from torch import Tensor

from groupgrad.kernels import _group
from groupgrad.kernels._group import PLAIN_TYPES, ListedFacts, dense, listed_facts

INPUT_DTYPES = WGRAD_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DTYPE_CHOICES = "torch.bfloat16, torch.float16 or torch.float32"


def row_out(
    out: object,
    shape: tuple[int, int],
    dtype: torch.dtype,
    a_name: str,
    a: Tensor,
    w_group: list[Tensor],
    listed: ListedFacts | None,
    label: _group.Labeler,
    also: Sequence[tuple[str, Tensor]] = (),
) -> Tensor:
    """fprop/dgrad's ``out`` (``(T, N)`` or ``(T, K)``): checked, or new when ``None``.

    ``dtype`` is the output's (the row operand's, or the dtype an FP8 row
    operand was quantized from); ``a``, ``w_group`` and ``also`` (named dense
    tensors: FP8 scales) are the tensors ``out`` must not overlap.
    """
    if out is None:
        return a.new_empty(shape, dtype=dtype)
    out_TX = cast(Tensor, out)
    if (  # the common out: plain, contiguous, like a, apart from a and packed weights
        type(out) in PLAIN_TYPES
        and not torch.compiler.is_compiling()
        and dense(out_TX)
        and out_TX.dtype == dtype
        and out_TX.device == a.device
        and out_TX.shape == shape
        and out_TX.is_contiguous()
        and not (out_TX.requires_grad and torch.is_grad_enabled())
        and listed is None
        and w_group[0].is_contiguous()
        and not _group.contiguous_meets(out_TX, (a, w_group[0], *[t for _, t in also]))
    ):
        return out_TX
    out_TX = tensor_arg("out", out)
    if out_TX.dtype != dtype:
        raise TypeError(f"out has dtype {out_TX.dtype}, expected {dtype} like {a_name}")
    check_device("out", out_TX, a_name, a)
    if tuple(out_TX.shape) != shape:
        dims = "(T, N)" if a_name == "x" else "(T, K)"
        raise ValueError(f"out has shape {tuple(out_TX.shape)}, expected {dims} = {shape}")
    check_row_major("out", out_TX)
    check_writable("out", out_TX)
    _group.check_group_apart(label, w_group, listed, [("out", out_TX)], [(a_name, a), *also])
    return out_TX


def fp8_row_out_dtype(out: object, op: str, a_name: str, source: torch.dtype) -> torch.dtype:
    """An FP8 fprop/dgrad's output dtype: ``out``'s, any of the GEMMs' output dtypes, or
    ``source`` (the dtype ``a_name`` was quantized from) without ``out``."""
    if not isinstance(out, Tensor):
        return source  # None (allocated in source), or not a tensor: row_out names it
    if out.dtype not in WGRAD_OUT_DTYPES:
        raise TypeError(
            f"out has dtype {out.dtype}, expected {DTYPE_CHOICES} (an FP8 {op} writes any of "
            f"them; {a_name} was quantized from {source})"
        )
    return out.dtype


def check_inner(op: str, a_name: str, cols: int, shape: tuple[int, int, int]) -> None:
    """fprop's ``x`` has ``K`` columns, dgrad's ``dy`` ``N``, for weights of ``shape``."""
    E, N, K = shape
    inner, inner_name = (K, "K") if op == "fprop" else (N, "N")
    if cols != inner:
        raise ValueError(
            f"{a_name} has {cols} columns, expected {inner_name} = {inner} "
            f"like weights of shape (E, N, K) = ({E}, {N}, {K})"
        )


def wgrad_splits(
    splits: object, x_rows: int, dy_rows: int, device: torch.device, accumulate: object
) -> tuple[Tensor, bool]:
    """A wgrad's token rules, whatever its operands' form: ``x`` and ``dy`` have the same
    rows, ``accumulate`` is a bool, and ``splits`` (checked as :func:`splits_arg`) has
    at least one entry. Returns ``(splits_E, accumulate)``."""
    if x_rows != dy_rows:
        raise ValueError(f"x has {x_rows} rows but dy has {dy_rows} rows")
    if type(accumulate) is not bool:
        kind = type(accumulate).__name__
        raise TypeError(f"accumulate is {accumulate!r} ({kind}), expected a bool")
    splits_E = splits_arg(splits, "x", x_rows, device, experts=None)
    if splits_E.shape[0] == 0:
        raise ValueError("splits has no entries, expected one token count per expert")
    return splits_E, accumulate


def wgrad_out(
    out: object,
    shape: tuple[int, int, int],
    out_dtype: object,
    accumulate: bool,
    default_dtype: torch.dtype,
    dy: Tensor,
    x: Tensor,
    names: object,
    also: Sequence[tuple[str, Tensor]] = (),
) -> tuple[list[Tensor], Tensor | Sequence[Tensor], ListedFacts | None]:
    """A wgrad's ``out`` of ``shape`` ``(E, N, K)``: ``(op form, result, listed facts)``.

    ``None`` allocates ``(E, N, K)`` in ``out_dtype`` or ``default_dtype``;
    ``dy``, ``x`` and ``also`` (named dense tensors: FP8 scales) are the
    tensors ``out`` must not overlap (``dy`` gives the device); ``names`` name
    ``out`` (``None``: ``out`` / ``out[e]``).
    """
    if out_dtype is not None and out_dtype not in WGRAD_OUT_DTYPES:
        raise TypeError(f"out_dtype is {out_dtype}, expected {DTYPE_CHOICES} or None")
    label = _group.labeler("out", names)
    E, N, K = shape
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out: there is nothing to accumulate into")
        dtype = default_dtype if out_dtype is None else out_dtype
        dw_ENK = torch.empty(shape, dtype=dtype, device=dy.device)
        return [dw_ENK], dw_ENK, None
    if isinstance(out, Tensor):
        _packed_wgrad_out(label(None), out, shape, out_dtype, dy, x, also)
        return [out], out, None
    if not ordered_collection(out):
        raise TypeError(
            f"{label(None)} must be an (E, N, K) tensor or a sequence of E (N, K) tensors, "
            f"got {type(out).__name__}"
        )
    members = list(out)
    if len(members) != E:
        raise ValueError(f"{label(None)} has {len(members)} tensors but splits has {E} entries")
    first = _wgrad_out_member(label(0), members[0], (N, K), "(N, K)", out_dtype, dy)
    listed = listed_facts(members, first)
    if not listed.alike or listed.requires_grad:
        for e, member in enumerate(members):
            dw_NK = _wgrad_out_member(label(e), member, (N, K), "(N, K)", out_dtype, dy)
            if dw_NK.dtype != first.dtype:
                raise TypeError(
                    f"{label(e)} has dtype {dw_NK.dtype}, expected {first.dtype} like {label(0)}"
                )
    _group.check_group_apart(label, members, listed, [], [("dy", dy), ("x", x), *also])
    result = cast("Tensor | Sequence[Tensor]", out)  # the caller's own object, returned as is
    return members, result, listed


def ordered_collection(value: object) -> TypeGuard[Iterable[Any]]:
    """Whether ``value`` may hold a group's members or the token counts: iterable in a fixed
    order, again and again (a list, a tuple, an ``nn.ParameterList``, a NumPy array) — not a
    set or a dict (their order is not the experts'), a generator (read once) or a string."""
    unordered = str | bytes | Set | Mapping | Iterator
    return isinstance(value, Iterable) and not isinstance(value, unordered)


def tensor_arg(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not dense(value):
        kind = "nested" if value.is_nested else value.layout
        raise TypeError(f"{name} is a {kind} tensor, expected a dense (torch.strided) one")
    return value


def input_matrix(name: str, value: object) -> Tensor:
    """A GEMM's row operand: a 2-D row-major bf16/fp16/fp32 tensor."""
    if (
        type(value) in PLAIN_TYPES
        and dense(cast(Tensor, value))
        and cast(Tensor, value).dtype in INPUT_DTYPES
        and cast(Tensor, value).dim() == 2
        and cast(Tensor, value).is_contiguous()
    ):
        return cast(Tensor, value)
    t = tensor_arg(name, value)
    if t.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {DTYPE_CHOICES}")
    if t.dim() != 2:
        dims = "(T, K)" if name == "x" else "(T, N)"
        raise ValueError(f"{name} must be 2-D {dims}, got shape {tuple(t.shape)}")
    check_row_major(name, t)
    return t


def weights_arg(
    weights: object, a_name: str, a: Tensor, label: _group.Labeler
) -> tuple[list[Tensor], tuple[int, int, int], ListedFacts | None]:
    """Check ``weights`` against the row operand ``a``; ``label(e)`` names member ``e``.

    Returns:
        The op form, ``(E, N, K)``, and what one pass over listed members
        found (:class:`~groupgrad.kernels._group.ListedFacts`; ``None`` for a packed tensor).
    """
    if (  # the common weights: one plain contiguous (E, N, K) tensor like a
        type(weights) in PLAIN_TYPES
        and dense(cast(Tensor, weights))
        and cast(Tensor, weights).dim() == 3
        and cast(Tensor, weights).dtype == a.dtype
        and cast(Tensor, weights).device == a.device
        and cast(Tensor, weights).is_contiguous()
        and cast(Tensor, weights).shape[0]
    ):
        w_ENK = cast(Tensor, weights)
        E, N, K = w_ENK.shape
        return [w_ENK], (E, N, K), None
    expected = "an (E, N, K) tensor or a sequence of E (N, K) tensors"
    if isinstance(weights, Tensor):
        name = label(None)
        if tensor_arg(name, weights).dim() != 3:
            raise ValueError(
                f"{name} must be {expected}, got a tensor of shape {tuple(weights.shape)}"
            )
        E, N, K = weights.shape
        if E == 0:
            raise ValueError(f"{name} has shape (0, N, K), expected at least one expert")
        _weight_member(name, weights, a_name, a, None, "")
        return _group.op_form(weights), (E, N, K), None
    if not ordered_collection(weights):
        raise TypeError(f"{label(None)} must be {expected}, got {type(weights).__name__}")
    members = list(weights)
    if not members:
        raise ValueError(f"{label(None)} holds no experts, expected {expected}")
    first = _weight_member(label(0), members[0], a_name, a, None, "")
    if first.dim() != 2:
        raise ValueError(f"{label(0)} must be 2-D (N, K), got shape {tuple(first.shape)}")
    listed = listed_facts(members, first)
    if not listed.alike:
        for e, member in enumerate(members):
            _weight_member(label(e), member, a_name, a, first, label(0))
    N, K = first.shape
    return _group.op_form(members), (len(members), N, K), listed


def _weight_member(
    name: str, value: object, a_name: str, a: Tensor, first: Tensor | None, first_name: str
) -> Tensor:
    """Check one weight (a listed member when ``first``, the listed first member, is given)."""
    w = tensor_arg(name, value)
    if first is not None:
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-D (N, K), got shape {tuple(w.shape)}")
        if w.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {w.dtype}, expected {first.dtype} like {first_name}")
        if w.shape != first.shape:
            raise ValueError(
                f"{name} has shape {tuple(w.shape)}, expected {tuple(first.shape)} like {first_name}"
            )
    if w.dtype != a.dtype:
        raise TypeError(f"{name} has dtype {w.dtype}, expected {a.dtype} like {a_name}")
    check_device(name, w, a_name, a)
    check_row_major(name, w)
    return w


def _wgrad_out_member(
    name: str,
    value: object,
    shape: tuple[int, ...],
    dims: str,
    out_dtype: object,
    dy: Tensor,
) -> Tensor:
    t = tensor_arg(name, value)
    if t.dtype not in WGRAD_OUT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {DTYPE_CHOICES}")
    if out_dtype is not None and t.dtype != out_dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but out_dtype is {out_dtype}")
    check_device(name, t, "dy", dy)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {dims} = {shape}")
    check_row_major(name, t)
    check_writable(name, t)
    return t


def _packed_wgrad_out(
    name: str,
    out: Tensor,
    shape: tuple[int, int, int],
    out_dtype: object,
    dy: Tensor,
    x: Tensor,
    also: Sequence[tuple[str, Tensor]],
) -> None:
    """A packed ``(E, N, K)`` wgrad output: shaped, typed and placed, its experts apart, apart
    from the inputs (``dy``, ``x`` and ``also``)."""
    if (  # the common out: plain, contiguous (so its experts are apart), apart from the inputs
        type(out) in PLAIN_TYPES
        and not torch.compiler.is_compiling()
        and dense(out)
        and out.shape == shape
        and out.dtype in WGRAD_OUT_DTYPES
        and (out_dtype is None or out.dtype == out_dtype)
        and out.device == dy.device
        and out.is_contiguous()
        and not (out.requires_grad and torch.is_grad_enabled())
        and not _group.contiguous_meets(out, (dy, x, *[t for _, t in also]))
    ):
        return
    _wgrad_out_member(name, out, shape, "(E, N, K)", out_dtype, dy)
    _group.check_experts_apart(out, name)
    _group.check_group_apart(name, [out], None, [], [("dy", dy), ("x", x), *also])


def splits_arg(
    splits: object, rows_name: str, rows: int, device: torch.device, experts: int | None
) -> Tensor:
    """``splits`` as an integer tensor (CPU or ``device``), checked against ``rows`` tokens.

    ``rows_name`` names the operand whose rows the counts split.
    """
    if (  # the common splits: a plain 1-D integer tensor of E counts on the CPU or rows' device
        type(splits) in PLAIN_TYPES
        and not torch.compiler.is_compiling()
        and dense(cast(Tensor, splits))
        and cast(Tensor, splits).dtype in _group.SPLITS_DTYPES
        and cast(Tensor, splits).dim() == 1
        and (experts is None or cast(Tensor, splits).shape[0] == experts)
    ):
        splits_E = cast(Tensor, splits)
        if splits_E.device.type == "cpu":
            if _group.counts_fit(splits_E.tolist(), rows):
                return splits_E
        elif splits_E.device == device and splits_E.shape[0]:
            return splits_E
    if isinstance(splits, Tensor):
        tensor_arg("splits", splits)
        if splits.dtype not in _group.SPLITS_DTYPES:
            raise TypeError(f"splits has dtype {splits.dtype}, expected torch.int32 or torch.int64")
        if splits.dim() != 1:
            raise ValueError(f"splits must be 1-D (E,), got shape {tuple(splits.shape)}")
        _check_length(splits.shape[0], experts)
        if splits.device.type != "cpu" and splits.device != device:
            where = "cpu" if device.type == "cpu" else f"cpu or {device}"
            raise ValueError(f"splits is on {splits.device}, expected {where} like {rows_name}")
        if splits.device.type == "cpu" and not torch.compiler.is_compiling():
            _group.check_values(splits.tolist(), rows, rows_name)
        elif splits.shape[0] == 0:  # no counts to read: none sum to rows but 0 rows
            _group.check_values([], rows, rows_name)
        return splits
    if not ordered_collection(splits):
        raise TypeError(
            f"splits must be a sequence of ints or an integer tensor, got {type(splits).__name__}"
        )
    values = [_token_count(e, count) for e, count in enumerate(splits)]
    _check_length(len(values), experts)
    _group.check_values(values, rows, rows_name)
    return torch.tensor(values, dtype=torch.int64)


def _token_count(index: int, count: object) -> int:
    if isinstance(count, bool):
        raise TypeError(f"splits[{index}] must be an int, got bool")
    try:
        return operator.index(count)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"splits[{index}] must be an int, got {type(count).__name__}") from None


def _check_length(length: int, experts: int | None) -> None:
    if experts is None:
        return
    if not torch.compiler.is_compiling():
        if length != experts:
            raise ValueError(f"splits has {length} entries but weights has {experts} experts")
        return
    # traced: a length from data (torch.bincount's) is a symbol, checked when the graph runs
    from torch.fx.experimental.symbolic_shapes import guard_or_false  # sympy: only when tracing

    if guard_or_false(length != experts):
        raise ValueError(f"splits has {length} entries but weights has {experts} experts")
    torch._check(length == experts, lambda: "splits has as many entries as weights has experts")


def check_device(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, expected {ref.device} like {ref_name}")


def check_row_major(name: str, t: Tensor) -> None:
    """Unit stride in the last dimension, rows at least a row apart (padding allowed)."""
    if t.is_contiguous():
        return
    inner_ok = t.shape[-1] <= 1 or t.stride(-1) == 1
    rows_ok = t.shape[-2] <= 1 or t.stride(-2) >= t.shape[-1]
    if not (inner_ok and rows_ok):
        raise ValueError(
            f"{name} must be row-major (stride 1 in the last dimension), got shape "
            f"{tuple(t.shape)} with strides {t.stride()}; call .contiguous()"
        )


def check_unrecorded(
    op: str, inputs: Sequence[tuple[str, Tensor | Sequence[Tensor]]], listed: ListedFacts | None
) -> None:
    """Reject inputs autograd would record: the kernels are not differentiable, so a gradient
    through their output would silently never reach them. An input may be a group of
    matrices (op form); ``listed`` is what one pass over a listed group found."""
    if not torch.is_grad_enabled():
        return
    for name, value in inputs:
        if isinstance(value, Tensor):
            recorded = value.requires_grad
        elif listed is not None and listed.alike:
            recorded = listed.requires_grad
        else:
            recorded = _group.any_requires_grad(value)
        if recorded:
            if not isinstance(value, Tensor):  # a group: name its first member that does
                name += f"[{next(i for i, t in enumerate(value) if t.requires_grad)}]"
            raise ValueError(
                f"{name} requires grad, but {op} is not differentiable: autograd would "
                f"give {name} no gradient through it; expected tensors that do not require grad "
                "(call it under torch.no_grad() or on detached tensors), or the autograd-aware "
                "layers of groupgrad.modules (grouped_linear, grouped_mlp)"
            )


def check_writable(name: str, t: Tensor) -> None:
    """Reject an output autograd tracks: the kernels write it in place, outside autograd."""
    if t.requires_grad and torch.is_grad_enabled():
        kind = "a leaf tensor" if t.is_leaf else "a tensor"
        raise ValueError(
            f"{name} is {kind} that requires grad; the kernels write out in place outside "
            "autograd, so expected a tensor that does not require grad (e.g. a main_grad "
            "buffer, or call under torch.no_grad())"
        )
