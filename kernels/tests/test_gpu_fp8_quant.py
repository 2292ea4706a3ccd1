"""The FP8 quantizers on a CUDA device (Triton, and the CUTLASS extension's one-read
activation quantizer): bit-identical to the reference, graphs, compile.

Run with ``nox -s tests-gpu`` or ``pytest -m gpu kernels/tests/test_gpu_fp8_quant.py``.
Data is compared as uint8, scales as int32 (NaN scales included). Outputs are
allocated inside the kernels, so the allocator's memory is poisoned with 0xFF
(an e4m3 NaN, a NaN scale) before each call: an element left unwritten fails.

Legend: ``T`` tokens, ``C`` channels, ``E`` experts, ``N``/``K`` weight rows/columns.
"""

from __future__ import annotations

import pytest
import torch

from groupgrad.kernels import (
    _fp8_ops,
    _swiglu_fp8,
    grouped_dgrad,
    grouped_fprop,
    grouped_wgrad,
    quantize_fp8,
    quantize_fp8_ref,
    swiglu_probs_backward_fp8,
    swiglu_probs_fp8,
)
from groupgrad.kernels._fp8_ops import load_triton_kernels, rows_op, segments_op, weights_op

pytestmark = pytest.mark.gpu(capability=(9, 0))

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SPLITS = [
    [4096],
    [1, 0, 127, 128, 129, 0, 3000, 7],
    [0, 0, 0, 5],
    [0, 0],
    [33] * 64,
    [7] * 150 + [0] * 150,  # more experts than the CUDA kernel's threads
]
#: Who quantizes an activation into its (128, 1) form (with or without its (1, 128) form):
#: on sm_90 the CUTLASS extension's one-read kernel for 16-bit inputs, else Triton.
ROUTES = ["cuda kernel if it takes x", "triton"]


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch) -> str:
    if request.param == "triton":  # the quantizers' and the FP8 SwiGLU backward's
        monkeypatch.setattr(_fp8_ops, "cuda_quantizer", lambda x, padded_tokens: None)
        monkeypatch.setattr(_swiglu_fp8, "cuda_quantizer", lambda x, padded_tokens: None)
    return request.param


def _poison() -> None:
    """Fill the allocator's cached blocks with 0xFF, so kernels get NaN-filled outputs."""
    free = torch.cuda.mem_get_info()[0]
    block = torch.empty(min(free // 4, 2**30), dtype=torch.uint8, device="cuda").fill_(0xFF)
    del block


def _same(got, want) -> None:
    for name in ("data", "data_t", "scales", "row_offsets", "seg_offsets", "block_offsets"):
        a, b = getattr(got, name), getattr(want, name)
        if a is None or b is None:
            assert a is None, name
            assert b is None, name
            continue
        assert a.shape == b.shape, name
        if a.numel():  # an empty tensor's strides carry no layout
            assert a.stride() == b.stride(), name
        view = {torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32}.get(a.dtype, a.dtype)
        assert torch.equal(a.view(view), b.view(view)), f"{name} differs from the reference"


def _inputs(T: int, C: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, C, device="cuda", generator=gen)
    x *= torch.logspace(-20, 20, C, device="cuda")  # ties, subnormal e4m3, saturation edges
    x = x.to(dtype)
    if T > 10 and C > 300:
        x[3, 5], x[7, 300], x[T - 1, C - 1] = float("nan"), float("inf"), -float("inf")
        x[5, 128:256] = 0
        if dtype == torch.float32:
            x[9, 0:128] = 1e-42  # subnormal fp32 block
    return x


def test_the_triton_kernels_load_on_this_machine() -> None:
    kernels, reason = load_triton_kernels()
    assert kernels is not None, f"the GPU path would fall back to the reference: {reason}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("T", "C"), [(1, 128), (129, 384), (4096, 1024), (0, 256)])
def test_rows_match_the_reference_bit_for_bit(dtype, T, C) -> None:
    x = _inputs(T, C, dtype, seed=T + C)
    _poison()
    _same(quantize_fp8(x, block=(1, 128)), quantize_fp8_ref(x, block=(1, 128)))


def _apart(w: torch.Tensor) -> list[torch.Tensor]:
    """Each expert in an allocation of its own, of a different size (never evenly spaced)."""
    return [
        torch.empty(m.numel() + 4096 * e, dtype=m.dtype, device=m.device)[: m.numel()]
        .view_as(m)
        .copy_(m)
        for e, m in enumerate(w)
    ]


# Every form takes one launch: views of one allocation evenly spaced, in either order (a flat
# parameter buffer), read expert e at e × spacing; other lists read each expert's address from
# a device table (test_listed_weights_routes: the stacked runs under capture).
FORMS = {
    "packed": lambda w: w,
    "separate": lambda w: [m.clone() for m in w],
    "strided": lambda w: [m.t().contiguous().t() for m in w],  # copied contiguous, then a table
    "apart": _apart,
    "views": lambda w: list(w.unbind(0)),
    "views reversed": lambda w: list(w.flip(0).contiguous().unbind(0))[::-1],
    "views every other": lambda w: list(torch.stack([w, torch.zeros_like(w)], dim=1)[:, 0]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize(("E", "N", "K"), [(1, 128, 128), (3, 384, 256), (8, 1536, 2048)])
def test_weights_match_the_reference_bit_for_bit(dtype, form, E, N, K) -> None:
    w = _inputs(E * N, K, dtype, seed=E + N + K).view(E, N, K)
    source = FORMS[form](w)
    _poison()
    _same(quantize_fp8(source, block=(128, 128)), quantize_fp8_ref(source, block=(128, 128)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_listed_weights_routes(dtype, monkeypatch) -> None:
    """Weights apart: an address table outside capture (no stacking copy); members not 16-byte
    aligned, and any list under CUDA-graph capture, take runs stacked by a copy — each bit for
    bit the reference, the captured graph too when replayed on new weight values."""
    kernels, _ = load_triton_kernels()
    stacked: list[int] = []
    runs = kernels._small_runs
    monkeypatch.setattr(kernels, "_small_runs", lambda ws: stacked.append(len(ws)) or runs(ws))
    w = _inputs(3 * 384, 256, dtype, seed=21).view(3, 384, 256)
    apart = _apart(w)
    _poison()
    _same(quantize_fp8(apart, block=(128, 128)), quantize_fp8_ref(apart, block=(128, 128)))
    assert stacked == [], "weights apart were stacked by a copy, not read through the table"
    odd = [  # one element past a 16-byte boundary, not evenly spaced
        torch.empty(m.numel() + 1 + 4096 * e, dtype=dtype, device="cuda")[1 : 1 + m.numel()]
        for e, m in enumerate(w)
    ]
    odd = [m.view_as(source).copy_(source) for m, source in zip(odd, w, strict=True)]
    _poison()
    _same(quantize_fp8(odd, block=(128, 128)), quantize_fp8_ref(odd, block=(128, 128)))
    assert stacked == [3]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = quantize_fp8(apart, block=(128, 128))
    assert stacked == [3, 3], "a captured call took the address table"
    for seed in (22, 23):
        new = _inputs(3 * 384, 256, dtype, seed=seed).view(3, 384, 256)
        for m, source in zip(apart, new, strict=True):
            m.copy_(source)
        graph.replay()
        _same(got, quantize_fp8_ref(apart, block=(128, 128)))


def test_a_listed_weights_table_is_copied_once_per_stream() -> None:
    """A list's address table reaches the device once and serves later calls on that stream
    (a layer's weights keep their addresses), also after the weights' values change; a call
    on another stream copies its own. Every call bit for bit the reference."""
    kernels, _ = load_triton_kernels()
    w = _inputs(3 * 384, 256, torch.bfloat16, seed=31).view(3, 384, 256)
    apart = _apart(w)
    starts = tuple(m.data_ptr() for m in apart)

    def table(stream: torch.cuda.Stream) -> torch.Tensor | None:
        return kernels._TABLES.get((apart[0].device.index, stream.cuda_stream, starts))

    main = torch.cuda.current_stream()
    _poison()
    _same(quantize_fp8(apart, block=(128, 128)), quantize_fp8_ref(apart, block=(128, 128)))
    first = table(main)
    assert first is not None, "the list was not read through a kept address table"
    new = _inputs(3 * 384, 256, torch.bfloat16, seed=32).view(3, 384, 256)
    for m, source in zip(apart, new, strict=True):
        m.copy_(source)
    _poison()
    _same(quantize_fp8(apart, block=(128, 128)), quantize_fp8_ref(apart, block=(128, 128)))
    assert table(main) is first, "the same list's table was copied to the device again"
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        got = quantize_fp8(apart, block=(128, 128))
    main.wait_stream(side)
    assert table(side) is not None, "a call on another stream kept no table of its own"
    assert table(side) is not first, "another stream shared a table"
    _same(got, quantize_fp8_ref(apart, block=(128, 128)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: f"E{len(s)}T{sum(s)}")
@pytest.mark.parametrize("splits_form", ["device int64", "device int32", "list"])
@pytest.mark.parametrize("with_rows", [False, True])
def test_segments_match_the_reference_bit_for_bit(
    dtype, splits, splits_form, with_rows, route
) -> None:
    x = _inputs(sum(splits), 512, dtype, seed=len(splits))
    given = {
        "device int64": torch.tensor(splits, device="cuda"),
        "device int32": torch.tensor(splits, device="cuda", dtype=torch.int32),
        "list": splits,
    }[splits_form]
    block = ((128, 1), (1, 128)) if with_rows else (128, 1)
    _poison()
    got = quantize_fp8(x, block=block, splits=given)
    want = quantize_fp8_ref(x, block=block, splits=splits)
    for g, w in zip(got if with_rows else [got], want if with_rows else [want], strict=True):
        _same(g, w)


#: Device splits a host check would reject, for T = 1000: past T, short of it, a negative count
#: with the right sum, no tokens, a count past T; and a negative count under a whole block.
MALFORMED = [[1400, 0, 500], [100, 0, 100], [1050, -50, 0], [0, 0, 0], [1000, 1000, -1000],
             [3, 5, -1, 993]]  # fmt: skip


@pytest.mark.parametrize("sizes", MALFORMED, ids=str)
def test_malformed_device_splits_give_nan_not_wrong_values(sizes, route) -> None:
    """No host check can see a device ``splits``: the kernels stay inside their tensors, every
    ``(128, 1)`` scale is NaN, bit for bit the reference's, so its ``dequantize`` is NaN; the
    ``(1, 128)`` form from the same read stays exact; so do the FP8 SwiGLU backward's token
    forms (NaN scales) and its rows form and ``dprobs``."""
    T, C = 1000, 512
    x = _inputs(T, C, torch.bfloat16, seed=13)
    splits = torch.tensor(sizes, device="cuda")
    _poison()
    rows, tokens = quantize_fp8(x, block=((1, 128), (128, 1)), splits=splits)
    _, want_tokens = quantize_fp8_ref(x, block=((1, 128), (128, 1)), splits=splits)
    torch.cuda.synchronize()  # a fault would surface here
    _same(rows, quantize_fp8_ref(x, block=(1, 128)))
    assert tokens.scales.isnan().all()
    assert torch.equal(tokens.scales.view(torch.int32), want_tokens.scales.view(torch.int32))
    assert tokens.dequantize().isnan().all()

    h, probs = x[:, :512], torch.rand(T, device="cuda")
    h_rows, _ = swiglu_probs_fp8(h, probs)
    da = _inputs(T, 256, torch.bfloat16, seed=15)
    got = swiglu_probs_backward_fp8(da, h_rows, probs, splits=splits)
    good = swiglu_probs_backward_fp8(da, h_rows, probs, splits=torch.tensor([T, 0], device="cuda"))
    torch.cuda.synchronize()
    _same(got[0], good[0])
    torch.testing.assert_close(got[2], good[2], rtol=0, atol=0, equal_nan=True)  # h has NaN rows
    for form in (got[1], got[3]):
        assert form.scales.isnan().all()
        assert form.dequantize().isnan().all()


@pytest.mark.parametrize("sizes", MALFORMED, ids=str)
def test_the_fp8_gemms_of_malformed_device_splits_give_nan(sizes) -> None:
    """The GEMMs' setup sees the same splits: it gives them no tiles and fills every output
    with NaN — fprop's and dgrad's whole output (their ``(1, 128)`` forms are exact), each
    expert's ``main_grad`` accumulating or overwriting, packed or listed."""
    T, C, N = 1000, 512, 256
    splits = torch.tensor(sizes, device="cuda")
    E = len(sizes)
    x_rows, x = quantize_fp8(
        _inputs(T, C, torch.bfloat16, seed=16), block=((1, 128), (128, 1)), splits=splits
    )
    dy_rows, dy = quantize_fp8(
        _inputs(T, N, torch.bfloat16, seed=14), block=((1, 128), (128, 1)), splits=splits
    )
    w = quantize_fp8(_inputs(E * N, C, torch.bfloat16, seed=17).view(E, N, C), block=(128, 128))
    outputs = {
        "fprop": grouped_fprop(x_rows, w, splits),
        "dgrad": grouped_dgrad(dy_rows, w, splits),
        "wgrad accumulating, packed": grouped_wgrad(
            dy, x, splits, out=torch.zeros(E, N, C, device="cuda"), accumulate=True
        ),
        "wgrad overwriting, listed": torch.stack(
            grouped_wgrad(dy, x, splits, out=[torch.zeros(N, C, device="cuda") for _ in range(E)])
        ),
    }
    for name, got in outputs.items():
        assert got.isnan().all(), f"{name}: {int((~got.isnan()).sum())} elements not NaN"


@pytest.mark.parametrize("E", [0, 1, 3, 300, 1025, 8192, 8193, 100_000])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("route", ["extension", "triton"])
def test_device_offsets_in_one_launch_match_the_reference(E, dtype, route, monkeypatch) -> None:
    """The CUTLASS extension's kernel (sm_90) and Triton's, against the reference, malformed
    (negative) counts included: Python's floor division, bit for bit."""
    from groupgrad.kernels._fp8_ops import offsets, offsets_ref

    if route == "triton":
        monkeypatch.setattr(_fp8_ops, "cuda_extension", lambda device: None)
    gen = torch.Generator().manual_seed(E)
    sizes = torch.randint(0, 300, (E,), generator=gen, dtype=dtype)
    sizes[:: max(E // 3, 1)] = 0  # empty experts
    sizes[1::7] *= -1  # malformed counts: their offsets still match the reference's
    sizes = sizes.cuda()
    _poison()
    got, want = offsets(sizes, 16), offsets_ref(sizes.cpu(), 16)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.int64
        assert torch.equal(g.cpu(), w)


def test_the_cuda_kernel_takes_16_bit_activations_and_leaves_the_rest_to_triton() -> None:
    """On sm_90 a contiguous, 16-byte aligned bfloat16 or float16 activation goes to the
    one-read kernel (so the route tests above test it); fp32 and a misaligned view go to
    Triton, and all give the reference's bits."""
    T, C = 1000, 256
    flat = torch.randn(T * C + 8, device="cuda").bfloat16()
    cases = {
        "bf16": (_inputs(T, C, torch.bfloat16, seed=7), True),
        "fp16": (_inputs(T, C, torch.float16, seed=8), True),
        "fp32": (_inputs(T, C, torch.float32, seed=9), False),
        "bf16 2 bytes off": (flat[1 : 1 + T * C].view(T, C), False),
        "bf16 16 bytes off": (flat[8 : 8 + T * C].view(T, C), True),
    }
    for name, (x, takes) in cases.items():
        padded = 1056  # T + 15 E rounded up to 16
        assert (_fp8_ops.cuda_quantizer(x, padded) is not None) == takes, name
        splits = [400, 0, 600]
        got = quantize_fp8(x, block=((1, 128), (128, 1)), splits=torch.tensor(splits).cuda())
        want = quantize_fp8_ref(x, block=((1, 128), (128, 1)), splits=splits)
        for g, w in zip(got, want, strict=True):
            _same(g, w)
    assert _fp8_ops.cuda_quantizer(cases["bf16"][0], 1048) is None  # not a multiple of 16


def test_a_cuda_graph_replays_with_new_device_splits() -> None:
    T, C = 1000, 256
    x = _inputs(T, C, torch.bfloat16, seed=1)
    splits = torch.tensor([500, 0, 500, 0], device="cuda")
    block = ((1, 128), (128, 1))
    quantize_fp8(x, block=block, splits=splits)  # warm up: Triton compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, segments = quantize_fp8(x, block=block, splits=splits)
    for new in ([1, 998, 0, 1], [0, 0, 0, 1000], [250, 250, 250, 250]):
        splits.copy_(torch.tensor(new))
        x.copy_(_inputs(T, C, torch.bfloat16, seed=sum(new[:2])))
        graph.replay()
        want_rows, want_segments = quantize_fp8_ref(x, block=block, splits=new)
        _same(rows, want_rows)
        _same(segments, want_segments)
        assert torch.equal(segments.dequantize(), want_segments.dequantize())


def test_torch_compile_fullgraph_runs_the_kernels() -> None:
    torch._dynamo.reset()

    def quantize_all(x, w, splits):
        rows, segments = quantize_fp8(x, block=((1, 128), (128, 1)), splits=splits)
        weights = quantize_fp8(w, block=(128, 128))
        return rows.data, segments.data, segments.scales, weights.data_t, weights.dequantize()

    x = _inputs(700, 512, torch.bfloat16, seed=2)
    w = _inputs(2 * 256, 384, torch.bfloat16, seed=3).view(2, 256, 384)
    splits = torch.tensor([300, 0, 400], device="cuda")
    compiled = torch.compile(quantize_all, fullgraph=True)
    for got, want in zip(compiled(x, w, splits), quantize_all(x, w, splits), strict=True):
        bits = {1: torch.uint8, 4: torch.int32}[got.element_size()]  # NaN scales compare too
        assert torch.equal(
            got.view(bits),
            want.view(bits),
        )


def test_opcheck_passes_on_cuda() -> None:
    x = _inputs(300, 256, torch.bfloat16, seed=4)
    torch.library.opcheck(rows_op, (x,))
    torch.library.opcheck(weights_op, ([x[:256].reshape(1, 256, 256)],))
    q = quantize_fp8_ref(x, block=(128, 1), splits=[100, 0, 200])
    for with_rows in (False, True):
        args = (x, q.row_offsets, q.seg_offsets, q.block_offsets, *q.scales.shape[:1])
        torch.library.opcheck(segments_op, (*args, q.data.shape[1], with_rows))
