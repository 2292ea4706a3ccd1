"""Semantics of the grouped GEMMs on the CPU, against fp64 per-expert oracles.

Each public kernel (which on the CPU runs the reference through its custom op)
and its ``*_ref`` twin is compared with an fp64 loop over experts computed
from the same seeded random inputs. Tolerance (STYLE.md): the error may be at
most twice that of PyTorch's own computation of the same thing in the same
dtypes, plus a small atol; NaN never passes; outputs are poisoned with NaN
before an overwrite so that an unwritten element fails.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from groupgrad_testsupport.gemms import GEMMS

# Token counts per expert: empty experts at the start, middle and end, skew, one expert.
SPLITS = {
    "empty_first": [0, 7, 13, 5, 11],
    "empty_middle": [9, 4, 0, 0, 12],
    "empty_last": [6, 10, 3, 17, 0],
    "skewed": [61, 1, 0, 2, 1],
    "uniform": [8, 8, 8, 8],
    "one_expert": [29],
    "no_tokens": [0, 0, 0],
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
N, K = 24, 40

KERNEL, REF = GEMMS["kernel"], GEMMS["ref"]


@dataclass
class Problem:
    splits: list[int]
    x: Tensor  # (T, K)
    w: Tensor  # (E, N, K)
    dy: Tensor  # (T, N)

    @property
    def E(self) -> int:
        return len(self.splits)

    @property
    def T(self) -> int:
        return sum(self.splits)

    def rows(self) -> list[slice]:
        bounds = torch.tensor([0, *self.splits]).cumsum(0).tolist()
        return [slice(lo, hi) for lo, hi in itertools.pairwise(bounds)]


def make_problem(splits: list[int], dtype: torch.dtype, seed: int = 0) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    T, E = sum(splits), len(splits)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return Problem(list(splits), draw(T, K), draw(E, N, K), draw(T, N))


def scattered(w_ENK: Tensor) -> list[Tensor]:
    """Per-expert copies that are not adjacent in memory; odd ones with padded rows."""
    members: list[Tensor] = []
    for w_NK in reversed(w_ENK.unbind(0)):
        if len(members) % 2:
            padded = torch.full((w_NK.shape[0], w_NK.shape[1] + 8), float("nan"), dtype=w_NK.dtype)
            padded[:, : w_NK.shape[1]] = w_NK
            members.append(padded[:, : w_NK.shape[1]])
        else:
            members.append(w_NK.clone())
    return members[::-1]


def nan_like(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def assert_close(result: Tensor, expected: Tensor, baseline: Tensor) -> None:
    """``result`` errs at most 2× as much as ``baseline`` (PyTorch's own) plus atol."""
    assert result.shape == expected.shape
    assert not result.isnan().any(), "NaN in result (an element was not written?)"
    expected = expected.double()
    error = (result.double() - expected).abs().max().item() if result.numel() else 0.0
    base = (baseline.double() - expected).abs().max().item() if result.numel() else 0.0
    atol = 1e-5 * max(1.0, expected.abs().max().item() if result.numel() else 0.0)
    assert error <= 2 * base + atol, f"error {error} > 2 × PyTorch's {base} + {atol}"


def per_expert(p: Problem, product: Callable[[slice, int], Tensor]) -> list[Tensor]:
    return [product(rows, e) for e, rows in enumerate(p.rows())]


def fprop64(p: Problem) -> Tensor:
    parts = per_expert(p, lambda r, e: p.x[r].double() @ p.w[e].double().T)
    return torch.cat(parts) if parts else torch.empty(0, N, dtype=torch.float64)


def fprop_torch(p: Problem) -> Tensor:
    return torch.cat(per_expert(p, lambda r, e: p.x[r] @ p.w[e].T))


def dgrad64(p: Problem) -> Tensor:
    return torch.cat(per_expert(p, lambda r, e: p.dy[r].double() @ p.w[e].double()))


def dgrad_torch(p: Problem) -> Tensor:
    return torch.cat(per_expert(p, lambda r, e: p.dy[r] @ p.w[e]))


def wgrad64(p: Problem) -> Tensor:
    return torch.stack(per_expert(p, lambda r, e: p.dy[r].double().T @ p.x[r].double()))


def wgrad_torch(p: Problem, out_dtype: torch.dtype) -> Tensor:
    """PyTorch's own: the GEMM in the input dtype, then cast to the output dtype."""
    return torch.stack(per_expert(p, lambda r, e: (p.dy[r].T @ p.x[r]).to(out_dtype)))


# --- fprop and dgrad ----------------------------------------------------------


# op: (seed, its operand, the output's width, the fp64 oracle, PyTorch's own computation)
FPROP_DGRAD = {
    "fprop": (0, lambda p: p.x, N, fprop64, fprop_torch),  # y = x @ w.T, (T, N)
    "dgrad": (1, lambda p: p.dy, K, dgrad64, dgrad_torch),  # dx = dy @ w, (T, K)
}


@pytest.mark.parametrize("impl", list(GEMMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", list(SPLITS))
@pytest.mark.parametrize("weights_form", ["packed", "scattered"])
@pytest.mark.parametrize("out_form", ["none", "given"])
@pytest.mark.parametrize("op", list(FPROP_DGRAD))
def test_fprop_and_dgrad_match_fp64(op, impl, dtype, pattern, weights_form, out_form):
    seed, operand, width, oracle, torch_own = FPROP_DGRAD[op]
    p = make_problem(SPLITS[pattern], dtype, seed=seed)
    weights = p.w if weights_form == "packed" else scattered(p.w)
    out = nan_like((p.T, width), dtype) if out_form == "given" else None
    result = getattr(GEMMS[impl], op)(operand(p), weights, p.splits, out=out)
    assert result.dtype == dtype
    assert result.shape == (p.T, width)
    if out is not None:
        assert result is out
    if p.T:
        assert_close(result, oracle(p), torch_own(p))


# --- wgrad ------------------------------------------------------------------------

# How the caller hands wgrad its output: (form, dtype or None for the input dtype).
WGRAD_OUTS = [
    ("none", None),
    ("out_dtype", torch.float32),
    ("tensor", None),
    ("tensor", torch.float32),
    ("list", torch.float32),
    ("list", torch.bfloat16),
    ("views", torch.float32),  # E views of one packed buffer, as a list
]


def wgrad_out(form: str, dtype: torch.dtype, E: int, fill: Callable[..., Tensor]) -> object:
    if form == "tensor":
        return fill((E, N, K), dtype)
    if form == "views":
        return list(fill((E, N, K), dtype).unbind(0))
    if form == "list":  # separate allocations, one with padded rows
        members = [fill((N, K), dtype) for _ in range(E)]
        padded = fill((N, K + 8), dtype)
        members[E // 2] = padded[:, :K].copy_(members[E // 2])
        return members
    return None


def stacked(out: object) -> Tensor:
    return out if isinstance(out, Tensor) else torch.stack(list(out))  # type: ignore[call-overload]


@pytest.mark.parametrize("impl", list(GEMMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", list(SPLITS))
@pytest.mark.parametrize(("form", "out_dtype"), WGRAD_OUTS, ids=lambda v: str(v))
def test_wgrad_overwrite_matches_fp64(impl, dtype, pattern, form, out_dtype):
    p = make_problem(SPLITS[pattern], dtype, seed=2)
    out_dtype = out_dtype or dtype
    out = wgrad_out(form, out_dtype, p.E, nan_like)
    kwargs = {"out_dtype": out_dtype} if form == "out_dtype" else {}
    dw = GEMMS[impl].wgrad(p.dy, p.x, p.splits, out=out, **kwargs)
    if out is not None:
        assert dw is out
    dw_ENK = stacked(dw)
    assert dw_ENK.dtype == out_dtype
    assert dw_ENK.shape == (p.E, N, K)
    for e, count in enumerate(p.splits):
        if count == 0:  # no tokens: exactly zero, whatever out held before
            assert torch.equal(dw_ENK[e], torch.zeros(N, K, dtype=out_dtype))
    assert_close(dw_ENK, wgrad64(p), wgrad_torch(p, out_dtype))


@pytest.mark.parametrize("impl", list(GEMMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("pattern", list(SPLITS))
@pytest.mark.parametrize(("form", "out_dtype"), WGRAD_OUTS[2:], ids=lambda v: str(v))
def test_wgrad_accumulate_matches_fp64(impl, dtype, pattern, form, out_dtype):
    p = make_problem(SPLITS[pattern], dtype, seed=3)
    out_dtype = out_dtype or dtype
    gen = torch.Generator().manual_seed(4)
    out = wgrad_out(form, out_dtype, p.E, lambda s, d: torch.randn(s, generator=gen).to(d))
    before = stacked(out).clone()
    dw = GEMMS[impl].wgrad(p.dy, p.x, p.splits, out=out, accumulate=True)
    assert dw is out
    dw_ENK = stacked(dw)
    for e, count in enumerate(p.splits):
        if count == 0:  # no tokens: untouched, bit for bit
            assert torch.equal(dw_ENK[e], before[e])
    baseline = before + wgrad_torch(p, out_dtype)  # PyTorch's own: GEMM, then add_
    assert_close(dw_ENK, before.double() + wgrad64(p), baseline)


def test_wgrad_accumulates_across_calls():
    p = make_problem([5, 0, 9, 3], torch.bfloat16, seed=5)
    main_grads = [torch.zeros(N, K) for _ in range(p.E)]
    for _ in range(3):
        KERNEL.wgrad(p.dy, p.x, p.splits, out=main_grads, accumulate=True)
    expected = 3 * wgrad64(p)
    assert_close(torch.stack(main_grads), expected, 3 * wgrad_torch(p, torch.float32))


# --- splits forms, returned objects, kernel vs twin -------------------------------


def splits_forms(splits: list[int]) -> dict[str, object]:
    return {
        "list": list(splits),
        "tuple": tuple(splits),
        "int32": torch.tensor(splits, dtype=torch.int32),
        "int64": torch.tensor(splits, dtype=torch.int64),
    }


@pytest.mark.parametrize("form", ["tuple", "int32", "int64"])
def test_splits_forms_agree(form):
    p = make_problem(SPLITS["empty_middle"], torch.bfloat16, seed=6)
    splits = splits_forms(p.splits)
    assert torch.equal(KERNEL.fprop(p.x, p.w, splits[form]), KERNEL.fprop(p.x, p.w, p.splits))
    assert torch.equal(KERNEL.dgrad(p.dy, p.w, splits[form]), KERNEL.dgrad(p.dy, p.w, p.splits))
    assert torch.equal(KERNEL.wgrad(p.dy, p.x, splits[form]), KERNEL.wgrad(p.dy, p.x, p.splits))


def test_wgrad_returns_the_same_sequence_object():
    p = make_problem([4, 0, 6], torch.bfloat16, seed=7)
    as_tuple = tuple(torch.empty(N, K) for _ in range(p.E))
    assert KERNEL.wgrad(p.dy, p.x, p.splits, out=as_tuple) is as_tuple
    assert REF.wgrad(p.dy, p.x, p.splits, out=as_tuple) is as_tuple


def test_default_output_dtype_is_the_input_dtype():
    p = make_problem([4, 0, 6], torch.float16, seed=8)
    assert KERNEL.wgrad(p.dy, p.x, p.splits).dtype == torch.float16
    assert KERNEL.wgrad(p.dy, p.x, p.splits, out_dtype=torch.bfloat16).dtype == (torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_and_twin_agree_bitwise_on_cpu(dtype):
    p = make_problem(SPLITS["skewed"], dtype, seed=9)
    assert torch.equal(KERNEL.fprop(p.x, p.w, p.splits), REF.fprop(p.x, p.w, p.splits))
    assert torch.equal(KERNEL.dgrad(p.dy, p.w, p.splits), REF.dgrad(p.dy, p.w, p.splits))
    kernel = KERNEL.wgrad(p.dy, p.x, p.splits, out_dtype=torch.float32)
    twin = REF.wgrad(p.dy, p.x, p.splits, out_dtype=torch.float32)
    assert torch.equal(kernel, twin)


def test_wgrad_does_not_read_overwritten_out():
    """Overwriting gives the same bits whatever out held (NaN, inf, garbage)."""
    p = make_problem([7, 0, 5, 2], torch.bfloat16, seed=10)
    results = []
    for fill in (float("nan"), float("inf"), -3.0):
        out = torch.full((p.E, N, K), fill)
        results.append(KERNEL.wgrad(p.dy, p.x, p.splits, out=out))
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_inputs_are_not_modified():
    p = make_problem([7, 0, 5, 2], torch.bfloat16, seed=11)
    copies = [t.clone() for t in (p.x, p.w, p.dy)]
    KERNEL.fprop(p.x, p.w, p.splits)
    KERNEL.dgrad(p.dy, p.w, p.splits)
    KERNEL.wgrad(p.dy, p.x, p.splits)
    assert all(torch.equal(a, b) for a, b in zip(copies, (p.x, p.w, p.dy), strict=True))
