"""The one support check (``_support.unsupported_reason``): which calls CUTLASS can take.

It reads tensor metadata only, so it runs here on CPU tensors. Each case
changes one thing of a supported call and expects the reason that names it;
the reason is what the fallback logs (``test_dispatch.py``).

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from groupgrad.kernels import quantize_fp8
from groupgrad.kernels._group import listed_facts
from groupgrad.kernels._support import fp8_placed, fp8_unsupported_reason, unsupported_reason

E, N, K = 4, 16, 24
T = 19


def rand(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def misaligned(t: Tensor) -> Tensor:
    """A copy of ``t`` whose data starts one element (2 or 4 bytes) past a 16-byte boundary."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16
    return view


def padded(rows: int, cols: int, dtype: torch.dtype, pad: int = 8) -> Tensor:
    """A ``(rows, cols)`` view with a padded row stride (``cols + pad``)."""
    return rand(rows, cols + pad, dtype=dtype)[:, :cols]


def fprop_case(change: str) -> tuple[Tensor, list[Tensor], Tensor]:
    x, w_ENK, y = rand(T, K), rand(E, N, K, seed=1), rand(T, N)
    if change == "none":
        return x, [w_ENK], y
    if change == "fp32":
        return x.float(), [w_ENK.float()], y.float()
    if change == "fp16-out":
        return x, [w_ENK], y.half()
    if change == "K=20":
        return rand(T, 20), [rand(E, N, 20)], y
    if change == "N=12":
        return x, [rand(E, 12, K)], rand(T, 12)
    if change == "x-misaligned":
        return misaligned(x), [w_ENK], y
    if change == "weights-misaligned":
        return x, [misaligned(w_ENK)], y
    if change == "weights-padded":
        return x, [rand(E, N, K + 8)[:, :, :K]], y
    if change == "out-padded":
        return x, [w_ENK], padded(T, N, torch.bfloat16)
    raise AssertionError(change)


FPROP_REASONS = {
    "none": None,
    "fp32": "torch.float32 inputs (CUTLASS takes torch.bfloat16 and torch.float16)",
    "fp16-out": "no compiled fprop kernel for torch.bfloat16 inputs with torch.float16 output",
    "K=20": "K = 20 is not a multiple of 8",
    "N=12": "N = 12 is not a multiple of 8",
    "x-misaligned": "x is not 16-byte aligned",
    "weights-misaligned": "weights is not 16-byte aligned",
    "weights-padded": "weights is not contiguous",
    "out-padded": "out is not contiguous",
}


@pytest.mark.parametrize("change", list(FPROP_REASONS))
def test_fprop_dense_operands_and_packed_weights(change: str) -> None:
    x, weights, y = fprop_case(change)
    assert unsupported_reason("fprop", x, weights, y) == FPROP_REASONS[change]


def test_dgrad_sizes_are_read_from_its_operands() -> None:
    dy, w_ENK = rand(T, N), rand(E, N, K, seed=1)
    assert unsupported_reason("dgrad", dy, [w_ENK], rand(T, K)) is None
    assert unsupported_reason("dgrad", dy, [rand(E, N, 20)], rand(T, 20)) == (
        "K = 20 is not a multiple of 8"
    )
    assert unsupported_reason("dgrad", misaligned(dy), [w_ENK], rand(T, K)) == (
        "dy is not 16-byte aligned"
    )


def test_wgrad_outputs_in_the_input_dtype_or_fp32() -> None:
    dy, x = rand(T, N), rand(T, K, seed=1)
    for dtype in (torch.bfloat16, torch.float32):
        assert unsupported_reason("wgrad", dy, x, [rand(E, N, K, dtype=dtype)]) is None
    assert unsupported_reason("wgrad", dy, x, [rand(E, N, K, dtype=torch.float16)]) == (
        "no compiled wgrad kernel for torch.bfloat16 inputs with torch.float16 output"
    )
    assert unsupported_reason("wgrad", dy, padded(T, K, torch.bfloat16), [rand(E, N, K)]) == (
        "x is not contiguous"
    )
    assert unsupported_reason("wgrad", dy, x, []) == "out holds no matrices"


def test_every_listed_member_is_checked() -> None:
    dy, x = rand(T, N), rand(T, K, seed=1)
    out = [rand(N, K, dtype=torch.float32, seed=e) for e in range(E)]
    separate = [padded(N, K, torch.float32) for _ in range(E)]  # row stride 32 fp32 = 128 bytes

    def reason(group: list[Tensor], a: Tensor = dy) -> str | None:
        return unsupported_reason("wgrad", a, x, group)

    assert reason(out) is None
    assert reason(separate) is None  # padded rows: fine for a listed member
    assert reason([*out[:2], *separate[2:]]) is None  # and strides may differ between members
    assert reason([*out[:3], misaligned(out[3])]) == "out[3] is not 16-byte aligned"
    odd_rows = [padded(N, K, torch.bfloat16, pad=1) for _ in range(E)]
    assert reason(odd_rows) == "out[0] row stride 25 is not a multiple of 16 bytes"
    assert reason([*out[:1], rand(N + 8, K, dtype=torch.float32), *out[2:]]) == (
        f"out[1] has shape ({N + 8}, {K}), out[0] ({N}, {K})"
    )
    transposed = rand(1, N, K, dtype=torch.float32)[0].t()
    assert reason([*out[:2], transposed, out[3]]) == f"out[2] is not row-major (strides (1, {K}))"
    assert reason([*out[:1], rand(1, N, K, dtype=torch.float32), *out[2:]]) == (
        "out[1] is 3-D, expected a 2-D matrix"
    )


def test_listed_weights_are_checked_like_listed_outputs() -> None:
    x, y = rand(T, K), rand(T, N)
    w_list = [rand(N, K, seed=e) for e in range(E)]
    assert unsupported_reason("fprop", x, w_list, y) is None
    assert unsupported_reason("fprop", x, [*w_list[:1], misaligned(w_list[1]), *w_list[2:]], y) == (
        "weights[1] is not 16-byte aligned"
    )


@pytest.mark.parametrize("read", [False, True], ids=["members", "listed-facts"])
def test_alike_members_are_still_checked_for_their_address(read: bool) -> None:
    # validation's pass over a listed group (ListedFacts) spares the stride
    # comparison of alike members, never the alignment of each one
    dy, x = rand(T, N), rand(T, K, seed=1)
    out = [rand(N, K, dtype=torch.float32, seed=e) for e in range(E)]

    def reason(op: str, a: Tensor, b: object, group: list[Tensor], c: object = None) -> str | None:
        listed = listed_facts(group, group[0]) if read else None
        assert listed is None or listed.alike
        operands = (a, b, group) if op == "wgrad" else (a, group, c)
        return unsupported_reason(op, *operands, listed=listed)  # type: ignore[arg-type]

    assert reason("wgrad", dy, x, out) is None
    for e in range(E):
        group = [*out[:e], misaligned(out[e]), *out[e + 1 :]]
        assert reason("wgrad", dy, x, group) == f"out[{e}] is not 16-byte aligned"
    w_list = [rand(N, K, seed=e) for e in range(E)]
    assert reason("fprop", x, None, [*w_list[:3], misaligned(w_list[3])], rand(T, N)) == (
        "weights[3] is not 16-byte aligned"
    )


def test_the_fp8_check_reads_each_operand_s_placement() -> None:
    # Catches: an FP8 operand's misaligned data or scales, or an out not contiguous or on
    # another device, taken by CUTLASS (the C++ entry refuses them: an error where the
    # reference path would serve the call).
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    data = [("dy.data", rand(N, 32, dtype=e4m3)), ("x.data", rand(K, 32, dtype=e4m3, seed=1))]
    scales = [("dy.scales", rand(2, N, dtype=f32)), ("x.scales", rand(2, K, dtype=f32, seed=2))]
    out = rand(E, N, K, dtype=torch.float32)

    def reason(**change: object) -> str | None:
        given = {"data": data, "scales": scales, "out": out, **change}
        return fp8_unsupported_reason(given["data"], given["scales"], given["out"])

    assert reason() is None
    assert reason(data=[data[0], ("x.data", misaligned(data[1][1]))]) == (
        "x.data is not 16-byte aligned"
    )
    assert reason(scales=[scales[0], ("x.scales", misaligned(scales[1][1]))]) == (
        "x.scales is not 16-byte aligned"
    )
    assert reason(out=out.transpose(1, 2)) == "out is not contiguous"
    assert reason(out=out.to("meta")) == "out is on meta, the inputs on cpu"
    members = list(out.unbind(0))
    assert reason(out=[*members[:3], misaligned(members[3])]) == "out[3] is not 16-byte aligned"
    # Operands whose seals found them placed are not read again; out always is.
    skewed = {"data": [data[0], ("x.data", misaligned(data[1][1]))]}
    skewed["scales"] = [scales[0], ("x.scales", misaligned(scales[1][1]))]
    assert fp8_unsupported_reason(skewed["data"], skewed["scales"], out, placed=True) is None
    assert fp8_unsupported_reason(data, scales, out.transpose(1, 2), placed=True) == (
        "out is not contiguous"
    )
    listed = [*members[:3], misaligned(members[3])]
    assert fp8_unsupported_reason(data, scales, listed, None, True) == (
        "out[3] is not 16-byte aligned"
    )


def test_fp8_operands_are_placed_when_their_data_either_way_and_scales_are() -> None:
    # Catches: an FP8 operand called placed whose transposed data is misaligned (dgrad reads
    # it), whose scales are, or whose rows pass int32 sizes.
    w = quantize_fp8(rand(2, 128, 256), block=(128, 128))
    assert fp8_placed([w.data, w.data_t], w.scales)
    assert not fp8_placed([w.data, misaligned(w.data_t)], w.scales)
    assert not fp8_placed([misaligned(w.data), w.data_t], w.scales)
    assert not fp8_placed([w.data, w.data_t], misaligned(w.scales))
    huge = torch.empty(2**31, 128, dtype=torch.float8_e4m3fn, device="meta")
    scales = torch.empty(1, 2**31, device="meta").t()
    assert not fp8_placed([huge], scales)
    assert fp8_placed([huge[:8]], scales[:8])
