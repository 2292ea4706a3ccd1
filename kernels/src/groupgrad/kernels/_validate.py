"""Argument checks and normalization for the grouped GEMMs.

Every public entry point — kernel and reference twin alike — passes its
arguments through :func:`grouped_call` (fprop, dgrad) or :func:`wgrad_call`
before anything is written, so a rejected call leaves ``out`` untouched.
Problems raise ``TypeError`` (wrong type or dtype) or ``ValueError`` (shape,
device, layout, token counts, overlap) naming the argument, its value and
what was expected.

What is checked for ``splits`` depends on where it lives:

* a Python sequence or a CPU tensor: length, dtype, and the values (each
  ``>= 0``, summing to the number of rows);
* a device tensor: length, dtype and device only — reading the values would
  synchronize the host. The reference path reads (and then checks) them
  anyway; the CUTLASS path never does.

Under ``torch.compile`` the checks that need real memory (the values of a
CPU ``splits`` tensor, overlap between outputs and inputs) are skipped; the
reference kernel still checks the values of ``splits`` when it reads them.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, cast

import torch
from torch import Tensor

from groupgrad.kernels import _grouped, _lean, _overlap, _splits
from groupgrad.kernels._calls import INPUT_DTYPES, WGRAD_OUT_DTYPES, GroupedCall, WgradCall
from groupgrad.kernels._listed import ListedFacts, listed_facts

_DTYPE_CHOICES = "torch.bfloat16, torch.float16 or torch.float32"


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
    ``weights[e]``); checked when a message needs it.
    """
    lean = _lean.packed_call(op, a, weights, splits, out)
    if lean is not None:
        return lean
    a_name = "x" if op == "fprop" else "dy"
    a_TX = _input_matrix(a_name, a)
    label = _labeler("weights", names)
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
    out_dims = "(T, N)" if op == "fprop" else "(T, K)"
    if out is None:
        out_TX = a_TX.new_empty(out_shape)
    else:
        out_TX = _tensor("out", out)
        if out_TX.dtype != a_TX.dtype:
            raise TypeError(f"out has dtype {out_TX.dtype}, expected {a_TX.dtype} like {a_name}")
        _check_device("out", out_TX, a_name, a_TX)
        if tuple(out_TX.shape) != out_shape:
            raise ValueError(
                f"out has shape {tuple(out_TX.shape)}, expected {out_dims} = {out_shape}"
            )
        _check_row_major("out", out_TX)
        _check_writable("out", out_TX)
        _check_group_apart(label, w_group, listed, [("out", out_TX)], [(a_name, a_TX)])
    return GroupedCall(a_TX, w_group, splits_E, out_TX, listed)


def wgrad_call(
    dy: object,
    x: object,
    splits: object,
    out: object,
    out_dtype: object,
    accumulate: object,
) -> WgradCall:
    """Check a wgrad call and put its arguments into op form."""
    lean = _lean.packed_wgrad_call(dy, x, splits, out, out_dtype, accumulate)
    if lean is not None:
        return lean
    dy_TN = _input_matrix("dy", dy)
    x_TK = _input_matrix("x", x)
    if x_TK.dtype != dy_TN.dtype:
        raise TypeError(f"x has dtype {x_TK.dtype}, expected {dy_TN.dtype} like dy")
    _check_device("x", x_TK, "dy", dy_TN)
    if x_TK.shape[0] != dy_TN.shape[0]:
        raise ValueError(f"x has {x_TK.shape[0]} rows but dy has {dy_TN.shape[0]} rows")
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    if out_dtype is not None and out_dtype not in WGRAD_OUT_DTYPES:
        raise TypeError(f"out_dtype is {out_dtype}, expected {_DTYPE_CHOICES} or None")
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
    listed = None
    if isinstance(out, Tensor):
        members = [out]
        _wgrad_out_member("out", out, (E, N, K), "(E, N, K)", out_dtype, dy_TN)
        _overlap.check_experts_apart(out)
    elif isinstance(out, Iterable) and not isinstance(out, str | bytes):
        members = list(out)
        if len(members) != E:
            raise ValueError(f"out has {len(members)} tensors but splits has {E} entries")
        first = _wgrad_out_member("out[0]", members[0], (N, K), "(N, K)", out_dtype, dy_TN)
        listed = listed_facts(members, first)
        if not listed.alike or listed.requires_grad:
            for e, member in enumerate(members):
                name = f"out[{e}]"
                dw_NK = _wgrad_out_member(name, member, (N, K), "(N, K)", out_dtype, dy_TN)
                if dw_NK.dtype != first.dtype:
                    raise TypeError(
                        f"{name} has dtype {dw_NK.dtype}, expected {first.dtype} like out[0]"
                    )
    else:
        raise TypeError(
            "out must be an (E, N, K) tensor or a sequence of E (N, K) tensors, "
            f"got {type(out).__name__}"
        )
    _check_group_apart("out", members, listed, [], [("dy", dy_TN), ("x", x_TK)])
    result = cast("Tensor | Sequence[Tensor]", out)  # the caller's own object, returned as is
    return WgradCall(dy_TN, x_TK, splits_E, members, accumulate, result, listed)


# --- pieces -----------------------------------------------------------------


def _tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _input_matrix(name: str, value: object) -> Tensor:
    t = _tensor(name, value)
    if t.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {_DTYPE_CHOICES}")
    if t.dim() != 2:
        dims = "(T, K)" if name == "x" else "(T, N)"
        raise ValueError(f"{name} must be 2-D {dims}, got shape {tuple(t.shape)}")
    _check_row_major(name, t)
    return t


def _weights(
    weights: object, a_name: str, a: Tensor, label: Labeler
) -> tuple[list[Tensor], tuple[int, int, int], ListedFacts | None]:
    """Check ``weights`` against the row operand ``a``; ``label(e)`` names member ``e``.

    Returns:
        The op form, ``(E, N, K)``, and what one pass over listed members
        found (``_listed``; ``None`` for a packed tensor).
    """
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
        return _grouped.op_form(weights), (E, N, K), None
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
    return _grouped.op_form(members), (len(members), N, K), listed


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


Labeler = Callable[[int | None], str]
"""How messages name a group: ``label(None)`` the group, ``label(e)`` its member ``e``."""


def _labeler(default: str, names: object) -> Labeler:
    """Name member ``e`` ``names[e]`` and a packed group ``names[0]``; else ``default[e]``, ``default``.

    Names only shape messages: where ``names`` has no entry for a member the
    default name is used.

    Raises:
        TypeError: ``names`` is neither ``None`` nor a sequence of strings.
    """
    given: list[str] = []
    if names is not None:
        if isinstance(names, str | bytes) or not isinstance(names, Sequence):
            raise TypeError(f"names is a {type(names).__name__}, expected a sequence of str")
        given = list(names)
        if not all(isinstance(n, str) for n in given):
            raise TypeError("names holds an entry that is not a str, expected a sequence of str")

    def label(e: int | None) -> str:
        if e is None:
            return given[0] if len(given) == 1 else default
        return given[e] if e < len(given) else f"{default}[{e}]"

    return label


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


def _splits_arg(splits: object, rows_name: str, rows_of: Tensor, experts: int | None) -> Tensor:
    """``splits`` as an integer tensor (CPU or ``rows_of``'s device), checked."""
    rows = rows_of.shape[0]
    if isinstance(splits, Tensor):
        if splits.dtype not in _splits.SPLITS_DTYPES:
            raise TypeError(f"splits has dtype {splits.dtype}, expected torch.int32 or torch.int64")
        if splits.dim() != 1:
            raise ValueError(f"splits must be 1-D (E,), got shape {tuple(splits.shape)}")
        _check_length(splits.shape[0], experts)
        if splits.device.type != "cpu" and splits.device != rows_of.device:
            where = "cpu" if rows_of.device.type == "cpu" else f"cpu or {rows_of.device}"
            raise ValueError(f"splits is on {splits.device}, expected {where} like {rows_name}")
        if splits.device.type == "cpu" and not torch.compiler.is_compiling():
            _splits.check_values(splits.tolist(), rows, rows_name)
        return splits
    if not isinstance(splits, Iterable) or isinstance(splits, str | bytes):
        raise TypeError(
            f"splits must be a sequence of ints or an integer tensor, got {type(splits).__name__}"
        )
    values = [_token_count(e, count) for e, count in enumerate(splits)]
    _check_length(len(values), experts)
    _splits.check_values(values, rows, rows_name)
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


def _check_group_apart(
    group_name: str | Labeler,
    group: list[Tensor],
    listed: ListedFacts | None,
    outputs: list[tuple[str, Tensor]],
    inputs: list[tuple[str, Tensor]],
) -> None:
    """The overlap rule for a group in op form beside the call's single ``outputs`` and ``inputs``.

    The group is the outputs (wgrad: ``outputs`` is then empty) or, with any
    ``outputs``, inputs (the weights). Alike listed members take the lean
    sweep over their sorted addresses (``listed.starts``, empty unless
    alike); the named check runs where there is no such sweep or it finds an
    overlap, and raises naming the culprits.
    """
    group_is_output = not outputs
    starts = listed.starts if listed is not None else ()
    singles = [(t, True) for _, t in outputs] + [(t, False) for _, t in inputs]
    if starts and _overlap.group_apart(starts, group[0].nbytes, group_is_output, singles):
        return
    named = _named(group_name, group)
    if group_is_output:
        _overlap.check_no_overlap(named, inputs)
    else:
        _overlap.check_no_overlap(outputs, [*inputs, *named])


def _named(label: str | Labeler, group: list[Tensor]) -> list[tuple[str, Tensor]]:
    """Each tensor of a group in op form with the name an error message gives it."""
    name = _labeler(label, None) if isinstance(label, str) else label
    if _grouped.is_packed(group):
        return [(name(None), group[0])]
    return [(name(i), t) for i, t in enumerate(group)]
