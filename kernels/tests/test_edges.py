"""Valid edge inputs of the grouped GEMMs give exactly the result an fp64 loop gives.

T = 0, E = 1, E = 4096, K = 0, N = 0, padded rows, and NaN/Inf that must stay
within the rows (and the expert) they belong to. Outputs are poisoned with
NaN first, so an element the kernel should have written but did not fails.
Each case runs through the public kernel and its reference twin.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from groupgrad_testsupport.gemms import GEMMS


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _nan(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _fp64_all(x: Tensor, w: Tensor, dy: Tensor, splits: list[int]):
    """fp64 ``y``, ``dx``, ``dw`` per expert; empty experts give empty rows and zero ``dw``."""
    ys, dxs, dws = [], [], []
    for e, (x_e, dy_e) in enumerate(zip(x.split(splits), dy.split(splits), strict=True)):
        w64 = w[e].double()
        ys.append(x_e.double() @ w64.T)
        dxs.append(dy_e.double() @ w64)
        dws.append(dy_e.double().T @ x_e.double())
    N, K = w.shape[1], w.shape[2]
    y = torch.cat(ys) if ys else torch.empty(0, N, dtype=torch.float64)
    dx = torch.cat(dxs) if dxs else torch.empty(0, K, dtype=torch.float64)
    return y, dx, torch.stack(dws)


def _run_all(impl: str, x: Tensor, w: Tensor, dy: Tensor, splits):
    fprop, dgrad, wgrad = GEMMS[impl]
    T, K = x.shape
    E, N, _ = w.shape
    y = fprop(x, w, splits, out=_nan(T, N, dtype=x.dtype))
    dx = dgrad(dy, w, splits, out=_nan(T, K, dtype=x.dtype))
    dw = wgrad(dy, x, splits, out=_nan(E, N, K))
    return y, dx, dw


def _assert_exact_enough(got: Tensor, want: Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=what)


@pytest.mark.parametrize("impl", list(GEMMS))
@pytest.mark.parametrize(
    ("case", "splits", "K", "N"),
    [
        ("no-tokens", [0, 0, 0], 8, 4),
        ("one-expert", [9], 8, 4),
        ("one-expert-no-tokens", [0], 8, 4),
        ("k-zero", [2, 0, 3], 0, 4),
        ("n-zero", [2, 0, 3], 8, 0),
        ("one-token", [0, 1, 0], 8, 4),
    ],
)
def test_small_edges_match_fp64(impl: str, case: str, splits: list[int], K: int, N: int) -> None:
    T, E = sum(splits), len(splits)
    x, w, dy = _rand(T, K, seed=1), _rand(E, N, K, seed=2), _rand(T, N, seed=3)
    y, dx, dw = _run_all(impl, x, w, dy, splits)
    want_y, want_dx, want_dw = _fp64_all(x, w, dy, splits)
    _assert_exact_enough(y, want_y, f"{case}: y")
    _assert_exact_enough(dx, want_dx, f"{case}: dx")
    _assert_exact_enough(dw, want_dw, f"{case}: dw (empty experts exactly zero)")


@pytest.mark.parametrize("impl", list(GEMMS))
def test_4096_experts_most_of_them_empty(impl: str) -> None:
    E, K, N = 4096, 8, 8
    splits = [0] * E
    for e, count in ((0, 3), (1777, 5), (4095, 2)):
        splits[e] = count
    T = sum(splits)
    x, w, dy = _rand(T, K, seed=4), _rand(E, N, K, seed=5), _rand(T, N, seed=6)
    y, dx, dw = _run_all(impl, x, w, dy, splits)
    want_y, want_dx, want_dw = _fp64_all(x, w, dy, splits)
    _assert_exact_enough(y, want_y, "y")
    _assert_exact_enough(dx, want_dx, "dx")
    _assert_exact_enough(dw, want_dw, "dw")


@pytest.mark.parametrize("impl", list(GEMMS))
def test_padded_rows_in_weights_and_outputs_are_honoured(impl: str) -> None:
    splits, K, N = [3, 0, 4], 8, 4
    T, E = sum(splits), len(splits)
    x, dy = _rand(T, K, seed=7), _rand(T, N, seed=8)
    storage = _nan(E, N, K + 8)  # each row padded by 8 NaN elements the GEMM must not read
    w = storage[:, :, :K]
    w.copy_(_rand(E, N, K, seed=9))
    fprop, _, wgrad = GEMMS[impl]
    y = fprop(x, list(w.unbind(0)), splits)
    out_storage = _nan(E, N, K + 8)
    outs = list(out_storage[:, :, :K].unbind(0))
    wgrad(dy, x, splits, out=outs)
    want_y, _, want_dw = _fp64_all(x, w, dy, splits)
    _assert_exact_enough(y, want_y, "y with padded weight rows")
    _assert_exact_enough(torch.stack(outs), want_dw, "dw into padded outputs")
    assert out_storage[:, :, K:].isnan().all(), "the padding of the outputs was written"


@pytest.mark.parametrize("impl", list(GEMMS))
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_inputs_stay_within_their_expert(impl: str, poison: float) -> None:
    splits, K, N = [3, 4, 2], 8, 4
    T, E = sum(splits), len(splits)
    x, w, dy = _rand(T, K, seed=10), _rand(E, N, K, seed=11), _rand(T, N, seed=12)
    x[4, 2] = poison  # a row of expert 1
    y, dx, dw = _run_all(impl, x, w, dy, splits)
    clean = x.clone()
    clean[4, 2] = 0.0
    want_y, _, want_dw = _fp64_all(clean, w, dy, splits)
    assert not y[4].isfinite().all()  # the poisoned row carries it
    rows = [r for r in range(T) if r != 4]
    _assert_exact_enough(y[rows], want_y[rows], "rows without the poisoned element")
    _assert_exact_enough(dx, _fp64_all(x, w, dy, splits)[1], "dx does not read x")
    _assert_exact_enough(dw[0], want_dw[0], "expert 0's wgrad")
    _assert_exact_enough(dw[2], want_dw[2], "expert 2's wgrad")
    assert not dw[1][:, 2].isfinite().all()  # expert 1's wgrad column of the element
