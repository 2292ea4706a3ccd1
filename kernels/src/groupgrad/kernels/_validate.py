"""The one validator of the grouped GEMMs: their argument rules, each written once.

Every public entry point — kernel and reference twin alike — passes its
arguments through :func:`grouped_call` (fprop, dgrad) or :func:`wgrad_call`
before anything is written, so a rejected call leaves ``out`` untouched, and
gets back a :class:`GroupedCall` or :class:`WgradCall` in op form. Problems
raise ``TypeError`` (wrong type or dtype) or ``ValueError`` (shape, device,
layout, token counts, overlap) naming the argument — as the caller named it,
through ``names`` — its value and what was expected.

Each rule has one form: one combined cheap test that accepts the common case
(plain contiguous tensors on one device, a packed group, integer ``splits``)
and, only when that test fails, the checks that name the misfit. So the
common call passes in one pass of cheap tests and a wrong one gets its
message from the same function.

What is checked for ``splits`` depends on where it lives:

* a Python sequence or a CPU tensor: length, dtype, and the values (each
  ``>= 0``, summing to the number of rows);
* a device tensor: length, dtype and device only — reading the values would
  synchronize the host. The reference path reads (and then checks) them
  anyway; the CUTLASS path never does.

Under ``torch.compile`` (fake and functional tensors: never the cheap test's
plain types) the checks that need real memory (the values of a CPU
``splits`` tensor, overlap between outputs and inputs) are skipped, a length
traced from data is checked when the graph runs, and the reference kernel
still checks the values of ``splits`` when it reads them.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import Tensor

from groupgrad.kernels import _group
from groupgrad.kernels._group import PLAIN_TYPES, ListedFacts, listed_facts

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WGRAD_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DTYPE_CHOICES = "torch.bfloat16, torch.float16 or torch.float32"


@dataclass(frozen=True)
class GroupedCall:
    """A validated fprop (``y_e = x_e @ w_e.T``) or dgrad (``dx_e = dy_e @ w_e``) call.

    ``a`` is ``x_TK`` for fprop and ``dy_TN`` for dgrad; ``out`` is ``y_TN``
    or ``dx_TK``; ``weights`` is in op form (``_group``); ``splits`` is
    ``splits_E``, an int32/int64 tensor on the CPU or ``a``'s device;
    ``listed`` holds what one pass over listed weights found (``None`` for
    packed weights).
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
    ``out`` is in op form (``[dw_ENK]`` or ``E`` matrices); ``result`` is
    what the public function returns (the caller's ``out`` object, or the
    freshly allocated ``(E, N, K)`` tensor); ``listed`` holds what one pass
    over listed outputs found (``None`` otherwise).
    """

    dy: Tensor
    x: Tensor
    splits: Tensor
    out: list[Tensor]
    accumulate: bool
    result: Tensor | Sequence[Tensor]
    listed: ListedFacts | None = None


def grouped_call(
    op: Literal["fprop", "dgrad"],
    a: object,
    weights: object,
    splits: object,
    out: object,
    names: object = None,
) -> GroupedCall:
    """Check an fprop/dgrad call and put its arguments into op form.

    ``names``: how messages name the weights (``None``: ``weights`` /
    ``weights[e]``).
    """
    a_name = "x" if op == "fprop" else "dy"
    a_TX = _input_matrix(a_name, a)
    label = _group.labeler("weights", names)
    w_group, (E, N, K), listed = _weights(weights, a_name, a_TX, label)
    T = a_TX.shape[0]
    inner, inner_name = (K, "K") if op == "fprop" else (N, "N")
    if a_TX.shape[1] != inner:
        raise ValueError(
            f"{a_name} has {a_TX.shape[1]} columns, expected {inner_name} = {inner} "
            f"like weights of shape (E, N, K) = ({E}, {N}, {K})"
        )
    splits_E = _splits_arg(splits, a_name, a_TX, experts=E)
    out_shape = (T, N) if op == "fprop" else (T, K)
    if out is None:
        return GroupedCall(a_TX, w_group, splits_E, a_TX.new_empty(out_shape), listed)
    out_TX = cast(Tensor, out)
    if (  # the common out: plain, contiguous, like a, apart from a and packed weights
        type(out) in PLAIN_TYPES
        and not torch.compiler.is_compiling()
        and out_TX.dtype == a_TX.dtype
        and out_TX.device == a_TX.device
        and out_TX.shape == out_shape
        and out_TX.is_contiguous()
        and not (out_TX.requires_grad and torch.is_grad_enabled())
        and listed is None
        and w_group[0].is_contiguous()
        and not _group.contiguous_meets(out_TX, (a_TX, w_group[0]))
    ):
        return GroupedCall(a_TX, w_group, splits_E, out_TX, listed)
    out_TX = _tensor("out", out)
    if out_TX.dtype != a_TX.dtype:
        raise TypeError(f"out has dtype {out_TX.dtype}, expected {a_TX.dtype} like {a_name}")
    _check_device("out", out_TX, a_name, a_TX)
    if tuple(out_TX.shape) != out_shape:
        dims = "(T, N)" if op == "fprop" else "(T, K)"
        raise ValueError(f"out has shape {tuple(out_TX.shape)}, expected {dims} = {out_shape}")
    _check_row_major("out", out_TX)
    _check_writable("out", out_TX)
    _group.check_group_apart(label, w_group, listed, [("out", out_TX)], [(a_name, a_TX)])
    return GroupedCall(a_TX, w_group, splits_E, out_TX, listed)


def wgrad_call(
    dy: object,
    x: object,
    splits: object,
    out: object,
    out_dtype: object,
    accumulate: object,
    names: object = None,
) -> WgradCall:
    """Check a wgrad call and put its arguments into op form.

    ``names``: how messages name ``out`` (``None``: ``out`` / ``out[e]``).
    """
    dy_TN = _input_matrix("dy", dy)
    x_TK = _input_matrix("x", x)
    if x_TK.dtype != dy_TN.dtype:
        raise TypeError(f"x has dtype {x_TK.dtype}, expected {dy_TN.dtype} like dy")
    _check_device("x", x_TK, "dy", dy_TN)
    if x_TK.shape[0] != dy_TN.shape[0]:
        raise ValueError(f"x has {x_TK.shape[0]} rows but dy has {dy_TN.shape[0]} rows")
    if type(accumulate) is not bool:
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    if out_dtype is not None and out_dtype not in WGRAD_OUT_DTYPES:
        raise TypeError(f"out_dtype is {out_dtype}, expected {_DTYPE_CHOICES} or None")
    label = _group.labeler("out", names)
    splits_E = _splits_arg(splits, "x", x_TK, experts=None)
    E, N, K = splits_E.shape[0], dy_TN.shape[1], x_TK.shape[1]
    if E == 0:
        raise ValueError("splits has no entries, expected one token count per expert")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out: there is nothing to accumulate into")
        dtype = dy_TN.dtype if out_dtype is None else out_dtype
        dw_ENK = torch.empty((E, N, K), dtype=dtype, device=dy_TN.device)
        return WgradCall(dy_TN, x_TK, splits_E, [dw_ENK], accumulate, dw_ENK)
    if isinstance(out, Tensor):
        _packed_wgrad_out(label(None), out, (E, N, K), out_dtype, dy_TN, x_TK)
        return WgradCall(dy_TN, x_TK, splits_E, [out], accumulate, out)
    if not isinstance(out, Iterable) or isinstance(out, str | bytes):
        raise TypeError(
            f"{label(None)} must be an (E, N, K) tensor or a sequence of E (N, K) tensors, "
            f"got {type(out).__name__}"
        )
    members = list(out)
    if len(members) != E:
        raise ValueError(f"{label(None)} has {len(members)} tensors but splits has {E} entries")
    first = _wgrad_out_member(label(0), members[0], (N, K), "(N, K)", out_dtype, dy_TN)
    listed = listed_facts(members, first)
    if not listed.alike or listed.requires_grad:
        for e, member in enumerate(members):
            dw_NK = _wgrad_out_member(label(e), member, (N, K), "(N, K)", out_dtype, dy_TN)
            if dw_NK.dtype != first.dtype:
                raise TypeError(
                    f"{label(e)} has dtype {dw_NK.dtype}, expected {first.dtype} like {label(0)}"
                )
    _group.check_group_apart(label, members, listed, [], [("dy", dy_TN), ("x", x_TK)])
    result = cast("Tensor | Sequence[Tensor]", out)  # the caller's own object, returned as is
    return WgradCall(dy_TN, x_TK, splits_E, members, accumulate, result, listed)


# --- pieces -----------------------------------------------------------------


def _tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _input_matrix(name: str, value: object) -> Tensor:
    """A GEMM's row operand: a 2-D row-major bf16/fp16/fp32 tensor."""
    if (
        type(value) in PLAIN_TYPES
        and cast(Tensor, value).dtype in INPUT_DTYPES
        and cast(Tensor, value).dim() == 2
        and cast(Tensor, value).is_contiguous()
    ):
        return cast(Tensor, value)
    t = _tensor(name, value)
    if t.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {_DTYPE_CHOICES}")
    if t.dim() != 2:
        dims = "(T, K)" if name == "x" else "(T, N)"
        raise ValueError(f"{name} must be 2-D {dims}, got shape {tuple(t.shape)}")
    _check_row_major(name, t)
    return t


def _weights(
    weights: object, a_name: str, a: Tensor, label: _group.Labeler
) -> tuple[list[Tensor], tuple[int, int, int], ListedFacts | None]:
    """Check ``weights`` against the row operand ``a``; ``label(e)`` names member ``e``.

    Returns:
        The op form, ``(E, N, K)``, and what one pass over listed members
        found (:class:`~groupgrad.kernels._group.ListedFacts`; ``None`` for a packed tensor).
    """
    if (  # the common weights: one plain contiguous (E, N, K) tensor like a
        type(weights) in PLAIN_TYPES
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
        if weights.dim() != 3:
            raise ValueError(
                f"{name} must be {expected}, got a tensor of shape {tuple(weights.shape)}"
            )
        E, N, K = weights.shape
        if E == 0:
            raise ValueError(f"{name} has shape (0, N, K), expected at least one expert")
        _weight_member(name, weights, a_name, a, None, "")
        return _group.op_form(weights), (E, N, K), None
    if not isinstance(weights, Iterable) or isinstance(weights, str | bytes):
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
    w = _tensor(name, value)
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
    _check_device(name, w, a_name, a)
    _check_row_major(name, w)
    return w


def _wgrad_out_member(
    name: str,
    value: object,
    shape: tuple[int, ...],
    dims: str,
    out_dtype: object,
    dy: Tensor,
) -> Tensor:
    t = _tensor(name, value)
    if t.dtype not in WGRAD_OUT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {_DTYPE_CHOICES}")
    if out_dtype is not None and t.dtype != out_dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but out_dtype is {out_dtype}")
    _check_device(name, t, "dy", dy)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {dims} = {shape}")
    _check_row_major(name, t)
    _check_writable(name, t)
    return t


def _packed_wgrad_out(
    name: str, out: Tensor, shape: tuple[int, int, int], out_dtype: object, dy: Tensor, x: Tensor
) -> None:
    """A packed ``(E, N, K)`` wgrad output: shaped, typed and placed, its experts apart, apart
    from the inputs."""
    if (  # the common out: plain, contiguous (so its experts are apart), apart from dy and x
        type(out) in PLAIN_TYPES
        and not torch.compiler.is_compiling()
        and out.shape == shape
        and out.dtype in WGRAD_OUT_DTYPES
        and (out_dtype is None or out.dtype == out_dtype)
        and out.device == dy.device
        and out.is_contiguous()
        and not (out.requires_grad and torch.is_grad_enabled())
        and not _group.contiguous_meets(out, (dy, x))
    ):
        return
    _wgrad_out_member(name, out, shape, "(E, N, K)", out_dtype, dy)
    _group.check_experts_apart(out, name)
    _group.check_group_apart(name, [out], None, [], [("dy", dy), ("x", x)])


def _splits_arg(splits: object, rows_name: str, rows_of: Tensor, experts: int | None) -> Tensor:
    """``splits`` as an integer tensor (CPU or ``rows_of``'s device), checked."""
    rows = rows_of.shape[0]
    if (  # the common splits: a plain 1-D integer tensor of E counts on the CPU or rows' device
        type(splits) in PLAIN_TYPES
        and not torch.compiler.is_compiling()
        and cast(Tensor, splits).dtype in _group.SPLITS_DTYPES
        and cast(Tensor, splits).dim() == 1
        and (experts is None or cast(Tensor, splits).shape[0] == experts)
    ):
        splits_E = cast(Tensor, splits)
        if splits_E.device.type == "cpu":
            if _group.counts_fit(splits_E.tolist(), rows):
                return splits_E
        elif splits_E.device == rows_of.device:
            return splits_E
    if isinstance(splits, Tensor):
        if splits.dtype not in _group.SPLITS_DTYPES:
            raise TypeError(f"splits has dtype {splits.dtype}, expected torch.int32 or torch.int64")
        if splits.dim() != 1:
            raise ValueError(f"splits must be 1-D (E,), got shape {tuple(splits.shape)}")
        _check_length(splits.shape[0], experts)
        if splits.device.type != "cpu" and splits.device != rows_of.device:
            where = "cpu" if rows_of.device.type == "cpu" else f"cpu or {rows_of.device}"
            raise ValueError(f"splits is on {splits.device}, expected {where} like {rows_name}")
        if splits.device.type == "cpu" and not torch.compiler.is_compiling():
            _group.check_values(splits.tolist(), rows, rows_name)
        return splits
    if not isinstance(splits, Iterable) or isinstance(splits, str | bytes):
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


def _check_device(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, expected {ref.device} like {ref_name}")


def _check_row_major(name: str, t: Tensor) -> None:
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


def _check_writable(name: str, t: Tensor) -> None:
    """Reject an output autograd tracks: the kernels write it in place, outside autograd."""
    if t.requires_grad and torch.is_grad_enabled():
        kind = "a leaf tensor" if t.is_leaf else "a tensor"
        raise ValueError(
            f"{name} is {kind} that requires grad; the kernels write out in place outside "
            "autograd, so expected a tensor that does not require grad (e.g. a main_grad "
            "buffer, or call under torch.no_grad())"
        )
