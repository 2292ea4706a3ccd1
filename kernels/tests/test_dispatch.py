"""Routing of the CUDA kernels (``_ops``) between CUTLASS and the reference.

The CUDA kernels are plain functions, so they run here on CPU tensors with a
fake ``groupgrad.kernels._cutlass`` that records its calls and computes with
the reference. This checks the internal contract (arguments, splits
conversion, op form), that the support check (``test_support.py``) is asked
before the backend, and that a fallback is logged once and never printed.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from typing import Any

import pytest
import torch
from torch import Tensor

from groupgrad.kernels import _ops, grouped_dgrad_ref, grouped_fprop_ref, grouped_wgrad_ref
from groupgrad.kernels._group import per_expert

E, N, K = 4, 16, 24
SPLITS = [5, 0, 11, 3]
T = sum(SPLITS)


class FakeCutlass(types.ModuleType):
    """Stands in for ``groupgrad.kernels._cutlass``: records calls, computes with the reference."""

    def __init__(self) -> None:
        super().__init__(_ops.CUTLASS_MODULE)
        self.reason: str | None = None
        self.asked: list[torch.device] = []
        self.calls: list[tuple[Any, ...]] = []

    def unavailable_reason(self, device):
        self.asked.append(device)
        return self.reason

    def fprop(self, x, w, splits, out):
        self.calls.append(("fprop", x, w, splits, out))
        grouped_fprop_ref(x, per_expert(w), splits.tolist(), out=out)

    def dgrad(self, dy, w, splits, out):
        self.calls.append(("dgrad", dy, w, splits, out))
        grouped_dgrad_ref(dy, per_expert(w), splits.tolist(), out=out)

    def wgrad(self, dy, x, splits, out, accumulate):
        self.calls.append(("wgrad", dy, x, splits, out, accumulate))
        grouped_wgrad_ref(dy, x, splits.tolist(), out=per_expert(out), accumulate=accumulate)


@pytest.fixture
def fake(monkeypatch):
    """A fresh fake backend in ``sys.modules``, with an empty import cache and log-once set."""
    backend = FakeCutlass()
    monkeypatch.setitem(sys.modules, _ops.CUTLASS_MODULE, backend)
    monkeypatch.setattr(_ops, "_reasons_said", set())
    _ops.load_cutlass.cache_clear()
    yield backend
    _ops.load_cutlass.cache_clear()


def rand(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def nans(*shape: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


# --- CUTLASS runs the call: the internal contract ---------------------------------


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("splits_dtype", [torch.int32, torch.int64], ids=str)
def test_fprop_hands_cutlass_packed_weights_whole_and_int64_splits(fake, splits_dtype, strided):
    x, w_ENK, y = rand(T, K), rand(E, N, K, seed=1), nans(T, N)
    splits = torch.tensor(SPLITS, dtype=splits_dtype)
    if strided:  # every other entry of a longer tensor: the kernels read a contiguous copy
        splits = torch.stack([splits, torch.full_like(splits, -7)], dim=1).reshape(-1)[::2]
    _ops.fprop_on_device(x, [w_ENK], splits, y)
    [(op, a, w_group, got_splits, out)] = fake.calls
    assert op == "fprop"
    assert a is x
    assert out is y
    assert isinstance(w_group, list)
    assert len(w_group) == 1  # packed: no per-expert views made on the host
    assert w_group[0] is w_ENK
    assert got_splits.dtype == torch.int64
    assert got_splits.is_contiguous()
    assert got_splits.tolist() == SPLITS
    assert fake.asked == [x.device]
    assert torch.equal(y, grouped_fprop_ref(x, w_ENK, SPLITS))


def test_dgrad_hands_cutlass_the_callers_weights(fake):
    dy, dx = rand(T, N), nans(T, K)
    w_list = [rand(N, K, seed=e) for e in range(E)]
    _ops.dgrad_on_device(dy, w_list, torch.tensor(SPLITS), dx)
    [(op, a, got_w, _, out)] = fake.calls
    assert op == "dgrad"
    assert a is dy
    assert out is dx
    assert all(g is w for g, w in zip(got_w, w_list, strict=True))
    assert torch.equal(dx, grouped_dgrad_ref(dy, w_list, SPLITS))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("out_form", ["packed", "list"])
def test_wgrad_hands_cutlass_a_list_of_outputs(fake, accumulate, out_form):
    dy, x = rand(T, N), rand(T, K, seed=1)
    main_ENK = rand(E, N, K, dtype=torch.float32, seed=2)
    out = [main_ENK] if out_form == "packed" else [t.clone() for t in main_ENK.unbind(0)]
    expected = grouped_wgrad_ref(dy, x, SPLITS, out=main_ENK.clone(), accumulate=accumulate)
    _ops.wgrad_on_device(dy, x, torch.tensor(SPLITS), out, accumulate)
    [(op, a, b, _, dw_group, got_accumulate)] = fake.calls
    assert (op, got_accumulate) == ("wgrad", accumulate)
    assert a is dy
    assert b is x
    assert isinstance(dw_group, list)
    assert len(dw_group) == len(out)  # the op form as given: packed stays packed
    assert all(g is o for g, o in zip(dw_group, out, strict=True))
    assert torch.equal(torch.stack(per_expert(dw_group)), expected)
    assert fake.asked == [dy.device]


# --- the reference runs instead ----------------------------------------------------


def test_unavailable_backend_falls_back_and_is_logged_once(fake, caplog, capsys):
    fake.reason = "no kernel for this shape"
    x, w_ENK = rand(T, K), rand(E, N, K, seed=1)
    with caplog.at_level(logging.WARNING, logger=_ops.__name__):
        for _ in range(3):
            y = nans(T, N)
            _ops.fprop_on_device(x, [w_ENK], torch.tensor(SPLITS), y)
            assert torch.equal(y, grouped_fprop_ref(x, w_ENK, SPLITS))
    assert fake.calls == []
    assert len(fake.asked) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["grouped_fprop runs on the reference path: no kernel for this shape"]
    assert capsys.readouterr() == ("", "")


def test_missing_backend_falls_back_and_is_logged_once(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, _ops.CUTLASS_MODULE, None)  # import fails
    monkeypatch.setattr(_ops, "_reasons_said", set())
    _ops.load_cutlass.cache_clear()
    try:
        dy, x, out = rand(T, N), rand(T, K, seed=1), [nans(N, K) for _ in range(E)]
        with caplog.at_level(logging.WARNING, logger=_ops.__name__):
            _ops.wgrad_on_device(dy, x, torch.tensor(SPLITS), out, False)
            _ops.wgrad_on_device(dy, x, torch.tensor(SPLITS), out, False)
    finally:
        _ops.load_cutlass.cache_clear()
    assert torch.equal(torch.stack(out), grouped_wgrad_ref(dy, x, SPLITS))
    [record] = caplog.records
    assert "grouped_wgrad runs on the reference path: the CUTLASS backend cannot be imported" in (
        record.getMessage()
    )


def test_unsupported_operands_fall_back_without_asking_the_backend(fake, caplog):
    x, w_ENK, y = rand(T, K), rand(E, N, K + 8, seed=1)[:, :, :K], nans(T, N)
    with caplog.at_level(logging.WARNING, logger=_ops.__name__):
        _ops.fprop_on_device(x, [w_ENK], torch.tensor(SPLITS), y)
    assert fake.calls == []
    assert fake.asked == []
    assert [r.getMessage() for r in caplog.records] == [
        "grouped_fprop runs on the reference path: weights is not contiguous"
    ]
    assert torch.equal(y, grouped_fprop_ref(x, w_ENK, SPLITS))


def test_backend_unavailable_on_a_cpu_device_without_initialising_cuda():
    code = (
        "import torch\n"
        "from groupgrad.kernels import _cutlass\n"
        "r = _cutlass.unavailable_reason(torch.device('cpu'))\n"
        "assert r == 'tensors are on cpu, not cuda', r\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_no_tokens_runs_nothing(fake):
    dy, x = rand(0, N), rand(0, K)
    out = [nans(N, K, dtype=torch.float32) for _ in range(E)]
    kept = [rand(N, K, dtype=torch.float32, seed=e) for e in range(E)]
    before = [t.clone() for t in kept]
    zeros = torch.zeros(E, dtype=torch.int64)
    _ops.wgrad_on_device(dy, x, zeros, out, False)
    _ops.wgrad_on_device(dy, x, zeros, kept, True)
    _ops.fprop_on_device(x, [rand(E, N, K)], zeros, nans(0, N))
    assert fake.calls == []
    assert fake.asked == []
    assert all(torch.equal(t, torch.zeros(N, K)) for t in out)
    assert all(torch.equal(a, b) for a, b in zip(kept, before, strict=True))


def test_reference_fallback_checks_splits_values(fake):
    fake.reason = "not today"
    x, w_ENK, y = rand(T, K), rand(E, N, K, seed=1), nans(T, N)
    with pytest.raises(ValueError, match=r"splits\[1\] is -1"):
        _ops.fprop_on_device(x, [w_ENK], torch.tensor([5, -1, 12, 3]), y)
    assert y.isnan().all()


def test_splits_on_device_keeps_values_and_makes_int64():
    from groupgrad.kernels import _group

    for dtype in (torch.int32, torch.int64):
        moved = _group.on_device(torch.tensor(SPLITS, dtype=dtype), torch.device("cpu"))
        assert moved.dtype == torch.int64
        assert moved.tolist() == SPLITS


def test_outputs_made_in_inference_mode_are_written_like_any_other(fake) -> None:
    # Catches: the reference writing an output made under torch.inference_mode() in place
    # outside that mode (PyTorch refuses): a RuntimeError after some experts were written,
    # where the CUDA kernels write every expert through its address.
    from groupgrad.kernels import grouped_dgrad, grouped_fprop, grouped_wgrad, quantize_fp8

    def inference(t: Tensor) -> Tensor:
        with torch.inference_mode():
            return t.clone()

    x, dy, w = rand(T, K), rand(T, N, seed=1), rand(E, N, K, seed=2)
    y, dx = grouped_fprop(x, w, SPLITS), grouped_dgrad(dy, w, SPLITS)
    assert torch.equal(grouped_fprop(x, w, SPLITS, out=inference(nans(T, N))), y)
    assert torch.equal(grouped_dgrad(dy, w, SPLITS, out=inference(nans(T, K))), dx)
    start = [rand(N, K, dtype=torch.float32, seed=3 + e) for e in range(E)]
    for op in (grouped_wgrad, grouped_wgrad_ref):
        want = op(dy, x, SPLITS, out=[t.clone() for t in start], accumulate=True)
        listed = [t.clone() for t in start]
        listed[2] = inference(listed[2])  # one main_grad of the group
        assert all(map(torch.equal, op(dy, x, SPLITS, out=listed, accumulate=True), want))
        packed = op(dy, x, SPLITS, out=inference(torch.stack(start)), accumulate=True)
        assert torch.equal(packed, torch.stack(want))
    splits = [130, 0, 60, 66]  # FP8: 128-column operands, the reference's NaN mask written too
    dy8, x8 = (quantize_fp8(rand(sum(splits), 128, seed=s), block=(128, 1), splits=splits)
               for s in (5, 6))  # fmt: skip
    want = grouped_wgrad(dy8, x8, splits)
    got = grouped_wgrad(dy8, x8, splits, out=[inference(nans(128, 128, dtype=torch.float32))
                                               for _ in splits])  # fmt: skip
    assert all(map(torch.equal, got, want))
    zeroed = [inference(nans(N, K, dtype=torch.float32)) for _ in range(E)]  # no tokens at all
    _ops.wgrad_on_device(rand(0, N), rand(0, K), torch.zeros(E, dtype=torch.int64), zeroed, False)
    assert all(torch.equal(t, torch.zeros(N, K)) for t in zeroed)
