"""The lean checks of the common call decide exactly as the detailed checks do.

``_validate.grouped_call`` and ``wgrad_call`` first try the lean pass of
``_lean`` over the common call (plain contiguous tensors, packed weights or output, integer
``splits``) and run the detailed checks only when it declines. The lean pass
must never accept what the detailed checks reject, nor hand back a different
call. Here every combination of valid and hostile arguments (wrong dtypes,
shapes, layouts, devices, ``splits``, overlaps, subclasses, autograd) runs
through both; the outcomes — the call, or the exception type and message —
must be identical.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from groupgrad.kernels import _lean, _validate

SPLITS = [3, 0, 5, 4]
E, T, N, K = 4, 12, 8, 16
BF16 = torch.bfloat16


class Marked(Tensor):
    """A tensor subclass (the lean pass leaves subclasses to the detailed checks)."""


def rand(*shape: int, dtype: torch.dtype = BF16) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


def column_major(t: Tensor) -> Tensor:
    return t.mT.contiguous().mT


def padded_rows(rows: int, cols: int, dtype: torch.dtype = BF16) -> Tensor:
    return torch.zeros(rows, cols + 8, dtype=dtype)[:, :cols]


def splits_variants() -> dict[str, Callable[[], object]]:
    return {
        "list": lambda: list(SPLITS),
        "cpu_int64": lambda: torch.tensor(SPLITS),
        "cpu_int32": lambda: torch.tensor(SPLITS, dtype=torch.int32),
        "float": lambda: torch.tensor(SPLITS, dtype=torch.float32),
        "0d": lambda: torch.tensor(T),
        "2d": lambda: torch.tensor([SPLITS]),
        "short": lambda: torch.tensor(SPLITS[:-1]),
        "negative": lambda: torch.tensor([3, -1, 6, 4]),
        "wrong_sum": lambda: torch.tensor([3, 0, 5, 5]),
        "meta": lambda: torch.tensor(SPLITS, device="meta"),
        "strided": lambda: torch.tensor([c for s in SPLITS for c in (s, -9)])[::2],
        "subclass": lambda: torch.tensor(SPLITS).as_subclass(Marked),
    }


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)


def same_tensor(ours: Tensor, theirs: Tensor, given: object) -> bool:
    """The caller's own tensor is handed through; a fresh one matches in shape, dtype, device."""
    if isinstance(given, Tensor):
        return ours is given and theirs is given
    return (ours.shape, ours.dtype, ours.device) == (theirs.shape, theirs.dtype, theirs.device)


def assert_same_outcome(lean: tuple[str, Any], detailed: tuple[str, Any], args: dict) -> None:
    assert lean[0] == detailed[0], (args, lean, detailed)
    if lean[0] != "ok":
        assert lean[1] == detailed[1], (args, lean, detailed)


def detailed_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_lean, "packed_call", lambda *args: None)
    monkeypatch.setattr(_lean, "packed_wgrad_call", lambda *args: None)


def accepted_calls(
    variants: dict[str, dict[str, Callable[[], object]]],
    lean: Callable[..., Any],
    check: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[dict[str, object], Any, Any]]:
    """Every combination of ``variants``, run through ``check`` (lean pass first) and through
    the detailed checks alone: both must decide alike.

    Yields:
        ``(arguments, the lean pass's call, the detailed checks' call)`` for each
        combination the lean pass accepted.
    """
    names = tuple(variants)
    for chosen in itertools.product(*(variants[name].items() for name in names)):
        args = {name: make() for name, (_, make) in zip(names, chosen, strict=True)}
        label = tuple(kind for kind, _ in chosen)
        lean_call = lean(*args.values())
        both = outcome(lambda args=args: check(*args.values()))
        with monkeypatch.context() as m:
            detailed_only(m)
            detailed = outcome(lambda args=args: check(*args.values()))
        assert_same_outcome(both, detailed, label)
        if lean_call is not None:
            assert detailed[0] == "ok", label
            yield args, lean_call, detailed[1]


# --------------------------------------------------------------------- fprop / dgrad


def grouped_variants(op: str) -> dict[str, dict[str, Callable[[], object]]]:
    inner, other = (K, N) if op == "fprop" else (N, K)
    a_base = rand(T, inner)
    w_base = rand(E, N, K)
    return {
        "a": {
            "valid": lambda: a_base,
            "fp32": lambda: a_base.float(),
            "int": lambda: torch.ones(T, inner, dtype=torch.int64),
            "3d": lambda: a_base.view(1, T, inner),
            "column_major": lambda: column_major(a_base),
            "wrong_inner": lambda: rand(T, inner + 8),
            "parameter": lambda: torch.nn.Parameter(a_base.clone()),
            "subclass": lambda: a_base.as_subclass(Marked),
            "meta": lambda: torch.empty(T, inner, dtype=BF16, device="meta"),
            "not_a_tensor": lambda: a_base.tolist(),
        },
        "weights": {
            "valid": lambda: w_base,
            "listed": lambda: list(w_base.unbind(0)),
            "fp16": lambda: w_base.half(),
            "2d": lambda: w_base[0],
            "no_experts": lambda: w_base[:0],
            "transposed": lambda: w_base.transpose(1, 2).contiguous().transpose(1, 2),
            "padded": lambda: torch.zeros(E, N, K + 8, dtype=BF16)[:, :, :K],
            "parameter": lambda: torch.nn.Parameter(w_base.clone()),
            "meta": lambda: torch.empty(E, N, K, dtype=BF16, device="meta"),
        },
        "splits": splits_variants(),
        "out": {
            "none": lambda: None,
            "valid": lambda: torch.zeros(T, other, dtype=BF16),
            "fp32": lambda: torch.zeros(T, other),
            "wrong_shape": lambda: torch.zeros(T, other + 8, dtype=BF16),
            "padded": lambda: padded_rows(T, other),
            "column_major": lambda: column_major(torch.zeros(T, other, dtype=BF16)),
            "requires_grad": lambda: torch.zeros(T, other, dtype=BF16, requires_grad=True),
            "meets_weights": lambda: w_base.view(-1)[: T * other].view(T, other),
            "subclass": lambda: torch.zeros(T, other, dtype=BF16).as_subclass(Marked),
            "meta": lambda: torch.empty(T, other, dtype=BF16, device="meta"),
            "not_a_tensor": lambda: [0.0] * T,
        },
    }


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("op", ["fprop", "dgrad"])
def test_grouped_lean_and_detailed_checks_agree(op, grad_mode, monkeypatch) -> None:
    lean_accepted = 0
    lean = functools.partial(_lean.packed_call, op)
    check = functools.partial(_validate.grouped_call, op)
    with torch.set_grad_enabled(grad_mode):
        for args, lean_call, theirs in accepted_calls(
            grouped_variants(op), lean, check, monkeypatch
        ):
            lean_accepted += 1
            assert lean_call.a is args["a"]
            assert theirs.a is args["a"]
            assert lean_call.weights == theirs.weights == [args["weights"]]
            assert lean_call.splits is theirs.splits
            assert same_tensor(lean_call.out, theirs.out, args["out"])
            assert lean_call.listed is None
            assert theirs.listed is None
    assert lean_accepted >= 4  # the common calls take the lean path (CPU and int32 splits, out)


# --------------------------------------------------------------------- wgrad


def wgrad_variants() -> dict[str, dict[str, Callable[[], object]]]:
    dy_base, x_base = rand(T, N), rand(T, K)
    shared = torch.zeros(E, N, K)  # an fp32 out whose memory the "in_shared" x also uses
    return {
        "dy": {
            "valid": lambda: dy_base,
            "fp16": lambda: dy_base.half(),
            "column_major": lambda: column_major(dy_base),
            "short": lambda: dy_base[:-1],
            "parameter": lambda: torch.nn.Parameter(dy_base.clone()),
            "subclass": lambda: dy_base.as_subclass(Marked),
        },
        "x": {
            "valid": lambda: x_base,
            "3d": lambda: x_base.view(1, T, K),
            "short": lambda: x_base[:-1],
            "meta": lambda: torch.empty(T, K, dtype=BF16, device="meta"),
            "in_shared": lambda: shared.view(-1).view(BF16)[: T * K].view(T, K),
        },
        "splits": splits_variants(),
        "out": {
            "none": lambda: None,
            "packed_fp32": lambda: torch.zeros(E, N, K),
            "packed_bf16": lambda: torch.zeros(E, N, K, dtype=BF16),
            "listed": lambda: [torch.zeros(N, K) for _ in range(E)],
            "int": lambda: torch.zeros(E, N, K, dtype=torch.int32),
            "wrong_shape": lambda: torch.zeros(E, K, N),
            "padded": lambda: torch.zeros(E, N, K + 4)[:, :, :K],
            "overlapping_experts": lambda: torch.zeros(E * N * K).as_strided((E, N, K), (K, K, 1)),
            "requires_grad": lambda: torch.zeros(E, N, K, requires_grad=True),
            "shared": lambda: shared,
            "meta": lambda: torch.empty(E, N, K, device="meta"),
        },
        "out_dtype": {
            "none": lambda: None,
            "fp32": lambda: torch.float32,
            "bf16": lambda: BF16,
            "int": lambda: torch.int64,
        },
        "accumulate": {"false": lambda: False, "true": lambda: True, "one": lambda: 1},
    }


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_wgrad_lean_and_detailed_checks_agree(grad_mode, monkeypatch) -> None:
    lean_accepted = 0
    lean, check = _lean.packed_wgrad_call, _validate.wgrad_call
    with torch.set_grad_enabled(grad_mode):
        for args, lean_call, theirs in accepted_calls(wgrad_variants(), lean, check, monkeypatch):
            lean_accepted += 1
            assert lean_call.dy is args["dy"]
            assert theirs.dy is args["dy"]
            assert lean_call.x is args["x"]
            assert theirs.x is args["x"]
            assert lean_call.splits is theirs.splits
            assert lean_call.accumulate is theirs.accumulate is args["accumulate"]
            assert len(lean_call.out) == len(theirs.out) == 1
            assert same_tensor(lean_call.out[0], theirs.out[0], args["out"])
            assert same_tensor(lean_call.result, theirs.result, args["out"])  # type: ignore[arg-type]
            assert lean_call.result is lean_call.out[0]
            assert lean_call.listed is None
            assert theirs.listed is None
    assert lean_accepted >= 4  # the common calls take the lean path
