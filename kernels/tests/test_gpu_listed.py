"""The C++ reader of listed groups (``listed_group_facts``) answers exactly what the Python one does.

Every check of a listed group on CUDA reads :class:`ListedFacts`; once the
CUTLASS extension is loaded, plain CUDA groups are read in C++. Each group
below — alike, or different in one way — is read both ways and the facts
must be equal; then the public calls on CUDA reject the same groups with the
same messages as on the CPU, and accept the valid ones.

Legend: ``E`` experts, ``N`` out_features, ``K`` in_features, ``T`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from groupgrad.kernels import (
    _cutlass,
    _group,
    grouped_fprop,
    grouped_fprop_ref,
    grouped_wgrad,
    grouped_wgrad_ref,
    tuning,
)

pytestmark = pytest.mark.gpu(capability=(9, 0))  # the reader ships with the sm_90a extension

E, N, K, T = 6, 16, 24, 40
SPLITS = [7, 0, 9, 5, 11, 8]


def _zeros(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.zeros(*shape, device="cuda", dtype=dtype)


def _members_with(change: str) -> list[object]:
    members: list[object] = [_zeros(N, K) for _ in range(E)]
    if change == "shape":
        members[3] = _zeros(N, K + 8)
    elif change == "dtype":
        members[2] = _zeros(N, K, dtype=torch.bfloat16)
    elif change == "cpu-member":
        members[4] = torch.zeros(N, K)
    elif change == "transposed":
        members[1] = _zeros(K, N).t()
    elif change == "padded":
        members[5] = _zeros(N, K + 8)[:, :K]
    elif change == "requires-grad":
        members[2] = _zeros(N, K).requires_grad_()
    elif change == "parameter":
        members[0] = torch.nn.Parameter(_zeros(N, K), requires_grad=False)
    elif change == "subclass":
        members[3] = _zeros(N, K).as_subclass(_Tagged)
    elif change == "not-a-tensor":
        members[1] = 3.0
    elif change == "views-of-one-buffer":
        members = list(_zeros(E, N, K).unbind(0))[::-1]
    elif change == "duplicate":
        members[4] = members[1]
    elif change == "empty":
        members = [_zeros(N, 0) for _ in range(E)]
    return members


class _Tagged(Tensor):
    """A trivial Tensor subclass: not plain, so the C++ reader hands it back to Python."""


CHANGES = [
    "none",
    "shape",
    "dtype",
    "cpu-member",
    "transposed",
    "padded",
    "requires-grad",
    "parameter",
    "subclass",
    "not-a-tensor",
    "views-of-one-buffer",
    "duplicate",
    "empty",
]


def _python_facts(members: list[object]) -> _group.ListedFacts:
    native = list(_group._native)
    _group._native.clear()
    try:
        return _group.listed_facts(members, members[0])  # type: ignore[arg-type]
    finally:
        _group._native[:] = native


@pytest.mark.parametrize("change", CHANGES)
def test_the_cpp_reader_agrees_with_python(change: str) -> None:
    _cutlass.build()
    assert _group._native, "loading the extension registers its reader"
    members = _members_with(change)
    native = _group._native[0](members)  # type: ignore[arg-type]
    python = _python_facts(members)
    both = _group.listed_facts(members, members[0])  # type: ignore[arg-type]
    assert both == python
    plain = all(type(m) in (Tensor, torch.nn.Parameter) for m in members)
    assert (native is None) == (not plain)
    if native is not None:
        alike, requires_grad, starts = native
        assert alike == python.alike
        assert (requires_grad, tuple(starts)) == ((python.requires_grad, python.starts))
    expect_alike = change in (
        "none", "requires-grad", "parameter", "subclass", "views-of-one-buffer", "duplicate", "empty"
    )  # fmt: skip
    assert python.alike == expect_alike


def _fits_in(buffer: Tensor, offset: int, *shape: int) -> Tensor:
    numel = 1
    for size in shape:
        numel *= size
    return buffer[offset:][:numel].view(*shape)


REJECTED: list[tuple[str, Callable[[dict], None], str]] = [
    ("member-shape", lambda a: a["out"].__setitem__(2, _zeros(N, K + 8)), r"out\[2\] has shape"),
    ("member-dtype", lambda a: a["out"].__setitem__(1, _zeros(N, K, dtype=torch.bfloat16)),
     r"out\[1\] has dtype torch\.bfloat16, expected torch\.float32 like out\[0\]"),
    ("members-alias", lambda a: a["out"].__setitem__(4, a["out"][0]),
     r"out\[[04]\] overlaps out\[[04]\] in memory"),
    ("member-holds-x", lambda a: a.update(out=[
        _fits_in(a["x"].view(-1), 5, N, K) if e == 3 else _zeros(N, K, dtype=torch.bfloat16)
        for e in range(E)]), r"out\[3\] overlaps x in memory"),
    ("member-requires-grad", lambda a: a["out"].__setitem__(5, _zeros(N, K).requires_grad_()),
     r"out\[5\] is a leaf tensor that requires grad"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "change", "match"), REJECTED, ids=[r[0] for r in REJECTED])
def test_listed_outputs_are_rejected_on_cuda_as_on_the_cpu(case, change, match) -> None:
    # the messages are those test_validation.py expects on the CPU (Python reader)
    _cutlass.build()  # the C++ reader is in use on CUDA
    gen = torch.Generator(device="cuda").manual_seed(len(case))
    dy = torch.randn(T, N, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = torch.randn(T, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    args = {"dy": dy, "x": x, "out": [_zeros(N, K) for _ in range(E)]}
    change(args)
    before = [m.clone() for m in args["out"]]
    with pytest.raises((ValueError, TypeError), match=match):
        grouped_wgrad(dy, x, SPLITS, out=args["out"], accumulate=True)
    assert all(torch.equal(a, b) for a, b in zip(before, args["out"], strict=True))


def test_alike_listed_groups_run_on_cutlass_and_match_the_reference() -> None:
    _cutlass.build()
    gen = torch.Generator(device="cuda").manual_seed(7)
    dy = torch.randn(T, N, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = torch.randn(T, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    buffer = torch.randn(E * N * K, device="cuda", generator=gen)
    out = [_fits_in(buffer, e * N * K, N, K) for e in range(E)][::-1]  # touching, not overlapping
    want = grouped_wgrad_ref(dy, x, SPLITS, out=[m.clone() for m in out], accumulate=True)
    assert tuning.fallback_reason("wgrad", dy, x, out) is None
    grouped_wgrad(dy, x, torch.tensor(SPLITS, device="cuda"), out=out, accumulate=True)
    for got, ref in zip(out, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    weights = [
        torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(E)
    ]
    y_TN = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
    assert tuning.fallback_reason("fprop", x, weights, y_TN) is None
    y = grouped_fprop(x, weights, torch.tensor(SPLITS, device="cuda"))
    torch.testing.assert_close(y, grouped_fprop_ref(x, weights, SPLITS), rtol=1.6e-2, atol=1e-2)
