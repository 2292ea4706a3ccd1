"""The CUTLASS backend (``groupgrad.kernels._cutlass``) against an fp64 reference, on an H100/H200.

Every compiled variant is run directly (explicit plan) and through the default
plan. Rule: a result may err at most twice as much as PyTorch's own computation
of the same thing in the same dtypes, plus a small atol; outputs are poisoned
with NaN before an overwrite, so an unwritten element fails.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from groupgrad.kernels import _cutlass, build, tuning
from groupgrad_testsupport import assert_as_close_as_torch, poison_, poisoned

pytestmark = pytest.mark.gpu(capability=(9, 0))  # the CUTLASS kernels are built for sm_90a

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}

# Token counts per expert: empty experts at the start, middle and end, odd counts,
# a single-token expert, everything in one expert, and a random draw.
SPLIT_PATTERNS: dict[str, list[int] | None] = {
    "empty_start_mid_end": [0, 129, 0, 77, 1, 0],
    "odd_and_one": [1, 255, 3, 64, 97, 17],
    "all_in_one": [0, 0, 0, 413, 0, 0],
    "no_tokens": [0, 0, 0, 0, 0, 0],
    "random": None,
}


def _splits(pattern: str, E: int, gen: torch.Generator) -> list[int]:
    fixed = SPLIT_PATTERNS[pattern]
    if fixed is None:
        return torch.randint(0, 300, (E,), generator=gen).tolist()
    return fixed[:E] + [0] * max(0, E - len(fixed))


def _gen(*parts: object) -> torch.Generator:
    """A generator seeded from the test's parameters (stable across processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).cuda()


def _group_list(
    E: int,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    layout: str,
    fill: Callable[[int], torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """E (rows, cols) matrices as ``(group argument, per-expert matrices)``.

    ``packed``: one (E, rows, cols) tensor handed over whole (the device addresses
    its matrices by stride); ``views``: the E views of one such tensor, listed;
    ``separate``: separate allocations, each with a padded row stride (ld = cols + 8).
    """
    if layout in ("packed", "views"):
        packed = torch.empty(E, rows, cols, dtype=dtype, device="cuda")
        mats = list(packed.unbind(0))
    else:
        mats = [torch.empty(rows, cols + 8, dtype=dtype, device="cuda")[:, :cols] for _ in range(E)]
    for i, m in enumerate(mats):
        m.copy_(fill(i))
    return ([packed] if layout == "packed" else mats), mats


LAYOUTS = ["packed", "views", "separate"]


def _bounds(splits: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for s in splits:
        out.append((start, start + s))
        start += s
    return out


def _check(ours: torch.Tensor, ref64: torch.Tensor, torch_own: torch.Tensor, what: str) -> None:
    """DESIGN's rule, with slack 1e-5 (fp32 outputs) or 2e-3 of the largest ``|ref64|``, plus 1e-6."""
    rtol = 1e-5 if ours.dtype == torch.float32 else 2e-3
    assert_as_close_as_torch(ours, ref64, torch_own, atol=1e-6, rtol=rtol, what=what)


def _variants(op: str) -> list[tuning.Variant]:
    return [v for v in tuning.VARIANTS if v.op == op]


def _plan(variant: tuning.Variant | None) -> tuning.Plan | None:
    return None if variant is None else tuning.Plan(variant.name)


# ---------------------------------------------------------------- fprop / dgrad


# op: (K, N); fprop reads x (T, K) and writes y = x @ w.T (T, N), dgrad reads
# dy (T, N) and writes dx = dy @ w (T, K)
FPROP_DGRAD_SIZES = {"fprop": (256, 384), "dgrad": (384, 256)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pattern", list(SPLIT_PATTERNS))
@pytest.mark.parametrize(
    ("op", "variant"),
    [(op, v) for op in FPROP_DGRAD_SIZES for v in [*_variants(op), None]],
    ids=lambda v: (v.name if v else "auto") if not isinstance(v, str) else v,
)
def test_fprop_dgrad(op: str, variant: tuning.Variant | None, pattern: str, layout: str) -> None:
    dtype = DTYPES[variant.dtype_in] if variant else torch.bfloat16
    gen = _gen(op, variant, pattern, layout)
    E, (K, N) = 6, FPROP_DGRAD_SIZES[op]
    splits = _splits(pattern, E, gen)
    T = sum(splits)
    a = _randn(T, K if op == "fprop" else N, dtype=dtype, gen=gen)  # x or dy
    group, w = _group_list(
        E, N, K, dtype, layout, lambda i: torch.randn(N, K, generator=gen).to(dtype)
    )
    out = poisoned((T, N if op == "fprop" else K), dtype=dtype, device="cuda")
    run = getattr(_cutlass, op)
    run(a, group, torch.tensor(splits, device="cuda"), out, plan=_plan(variant))
    for e, (lo, hi) in enumerate(_bounds(splits)):
        b = w[e].T if op == "fprop" else w[e]
        ref = a[lo:hi].double() @ b.double()
        _check(out[lo:hi], ref, a[lo:hi] @ b, f"{op} expert {e}")


# ---------------------------------------------------------------- wgrad


def _wgrad_torch_own(
    dy_e: torch.Tensor,
    x_e: torch.Tensor,
    c: torch.Tensor | None,
    accumulate: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """PyTorch's own computation of the same thing: cuBLAS in the output's precision."""
    if out_dtype == torch.float32:
        prod = dy_e.float().T @ x_e.float()
        return prod if c is None else c + prod
    return dy_e.T @ x_e if c is None else torch.addmm(c, dy_e.T, x_e)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
@pytest.mark.parametrize("pattern", list(SPLIT_PATTERNS))
@pytest.mark.parametrize(
    "variant", [*_variants("wgrad"), None], ids=lambda v: v.name if v else "auto"
)
def test_wgrad(variant: tuning.Variant | None, pattern: str, accumulate: bool, layout: str) -> None:
    din = DTYPES[variant.dtype_in] if variant else torch.bfloat16
    dout = DTYPES[variant.dtype_out] if variant else torch.float32
    gen = _gen("wgrad", variant, pattern, accumulate, layout)
    E, K, N = 6, 256, 384
    splits = _splits(pattern, E, gen)
    T = sum(splits)
    dy = _randn(T, N, dtype=din, gen=gen)
    x = _randn(T, K, dtype=din, gen=gen)
    if accumulate:
        start = [torch.randn(N, K, generator=gen).to(dout) for _ in range(E)]
        group, out = _group_list(E, N, K, dout, layout, lambda i: start[i])
    else:
        group, out = _group_list(E, N, K, dout, layout, lambda i: poisoned((N, K)))
    _cutlass.wgrad(
        dy, x, torch.tensor(splits, device="cuda"), group, accumulate, plan=_plan(variant)
    )
    for e, (lo, hi) in enumerate(_bounds(splits)):
        c = start[e].cuda() if accumulate else None
        if hi == lo:  # no tokens: untouched when accumulating, exact zeros when overwriting
            expected = torch.zeros_like(out[e]) if c is None else c
            assert torch.equal(out[e], expected), f"empty expert {e} was not left exact"
            continue
        ref = dy[lo:hi].double().T @ x[lo:hi].double()
        if c is not None:
            ref = ref + c.double()
        own = _wgrad_torch_own(dy[lo:hi], x[lo:hi], c, accumulate, dout)
        _check(out[e], ref, own, f"wgrad expert {e}")


@pytest.mark.parametrize("swizzle", [1, 4])
@pytest.mark.parametrize("raster_along_n", [False, True], ids=["rasterM", "rasterN"])
@pytest.mark.parametrize("op", ["fprop", "wgrad"])
def test_scheduler_options(op: str, raster_along_n: bool, swizzle: int) -> None:
    """Raster order and swizzle of the persistent scheduler (benchmark knobs) stay exact."""
    gen = _gen("sched", op, raster_along_n, swizzle)
    E, K, N = 6, 256, 384
    splits = _splits("empty_start_mid_end", E, gen)
    T = sum(splits)
    x = _randn(T, K, dtype=torch.bfloat16, gen=gen)
    for variant in _variants(op):
        if variant.dtype_in != "bf16" or (variant.dtype_out == "bf16" and op == "wgrad"):
            continue
        plan = tuning.Plan(variant.name, raster_along_n, swizzle)
        if op == "fprop":
            w = [_randn(N, K, dtype=torch.bfloat16, gen=gen) for _ in range(E)]
            y = poisoned((T, N), dtype=torch.bfloat16, device="cuda")
            _cutlass.fprop(x, w, torch.tensor(splits, device="cuda"), y, plan=plan)
            for e, (lo, hi) in enumerate(_bounds(splits)):
                ref = x[lo:hi].double() @ w[e].double().T
                _check(y[lo:hi], ref, x[lo:hi] @ w[e].T, f"{plan} expert {e}")
        else:
            dy = _randn(T, N, dtype=torch.bfloat16, gen=gen)
            dw = [poisoned((N, K), device="cuda") for _ in range(E)]
            _cutlass.wgrad(dy, x, torch.tensor(splits, device="cuda"), dw, False, plan=plan)
            for e, (lo, hi) in enumerate(_bounds(splits)):
                ref = dy[lo:hi].double().T @ x[lo:hi].double()
                own = dy[lo:hi].float().T @ x[lo:hi].float()
                _check(dw[e], ref, own, f"{plan} expert {e}")


# ---------------------------------------------------------------- no host sync, graphs


def _graph_case(
    op: str, gen: torch.Generator
) -> tuple[int, int, int, int, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    E, K, N, T = 5, 128, 256, 600
    x = _randn(T, K, dtype=torch.bfloat16, gen=gen)
    dy = _randn(T, N, dtype=torch.bfloat16, gen=gen)
    w = [_randn(N, K, dtype=torch.bfloat16, gen=gen) for _ in range(E)]
    return E, K, N, T, x, dy, w


NEW_SPLITS = ([0, 300, 1, 0, 299], [600, 0, 0, 0, 0], [120, 120, 120, 120, 120])  # same T


def _capture(call: Callable[[], None]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up outside capture (builds or loads the extension)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


@pytest.mark.parametrize("form", ["packed", "list"])
@pytest.mark.parametrize("op", ["fprop", "dgrad"])
def test_graph_replay_with_new_splits_fprop_dgrad(op: str, form: str) -> None:
    """Captured once; replayed after the device splits change (same T)."""
    _E, K, N, T, x, dy, w = _graph_case(op, _gen("graph", op))
    group = [torch.stack(w)] if form == "packed" else w
    splits_dev = torch.tensor([100, 200, 0, 250, 50], device="cuda")
    a = x if op == "fprop" else dy
    out = torch.empty(T, N if op == "fprop" else K, dtype=torch.bfloat16, device="cuda")
    backend = _cutlass.fprop if op == "fprop" else _cutlass.dgrad
    graph = _capture(lambda: backend(a, group, splits_dev, out))
    for new in NEW_SPLITS:
        splits_dev.copy_(torch.tensor(new))
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        for e, (lo, hi) in enumerate(_bounds(new)):
            w_e = w[e].T if op == "fprop" else w[e]
            _check(out[lo:hi], a[lo:hi].double() @ w_e.double(), a[lo:hi] @ w_e, f"{op} {new} {e}")


@pytest.mark.parametrize("form", ["packed", "list"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
def test_graph_replay_with_new_splits_wgrad(accumulate: bool, form: str) -> None:
    """Captured once; replayed with new splits, including experts that become empty."""
    gen = _gen("graph", "wgrad", accumulate, form)
    E, K, N, _T, x, dy, _ = _graph_case("wgrad", gen)
    splits_dev = torch.tensor([100, 200, 0, 250, 50], device="cuda")
    if form == "packed":
        packed = torch.zeros(E, N, K, device="cuda")
        group, out = [packed], list(packed.unbind(0))
    else:
        out = [torch.zeros(N, K, device="cuda") for _ in range(E)]
        group = out
    graph = _capture(lambda: _cutlass.wgrad(dy, x, splits_dev, group, accumulate))
    for new in NEW_SPLITS:
        splits_dev.copy_(torch.tensor(new))
        start = [torch.randn(N, K, generator=gen).cuda() for _ in range(E)]
        for o, s in zip(out, start, strict=True):
            o.copy_(s if accumulate else torch.full_like(s, float("nan")))
        graph.replay()
        torch.cuda.synchronize()
        for e, (lo, hi) in enumerate(_bounds(new)):
            base = start[e] if accumulate else torch.zeros_like(start[e])
            if hi == lo:
                assert torch.equal(out[e], base), f"replay {new}: empty expert {e}"
                continue
            ref = dy[lo:hi].double().T @ x[lo:hi].double() + base.double()
            own = dy[lo:hi].float().T @ x[lo:hi].float() + base
            _check(out[e], ref, own, f"wgrad replay {new} expert {e}")


def test_device_splits_never_sync_the_host() -> None:
    gen = torch.Generator().manual_seed(3)
    E, K, N, T, x, dy, w = _graph_case("fprop", gen)
    splits_dev = torch.tensor([100, 200, 0, 250, 50], device="cuda")
    y = torch.empty(T, N, dtype=torch.bfloat16, device="cuda")
    dx = torch.empty(T, K, dtype=torch.bfloat16, device="cuda")
    dw = [torch.empty(N, K, dtype=torch.float32, device="cuda") for _ in range(E)]
    _cutlass.fprop(x, w, splits_dev, y)  # build/load first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _cutlass.fprop(x, w, splits_dev, y)
        _cutlass.dgrad(dy, w, splits_dev, dx)
        _cutlass.wgrad(dy, x, splits_dev, dw, False)
        _cutlass.wgrad(dy, x, splits_dev, dw, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_many_groups_take_several_setup_launches() -> None:
    """E above the per-launch bound of the setup kernel (128 groups)."""
    gen = torch.Generator().manual_seed(11)
    E, K, N = 300, 64, 128
    splits = torch.randint(0, 9, (E,), generator=gen)
    splits[::7] = 0
    T = int(splits.sum())
    dy = _randn(T, N, dtype=torch.bfloat16, gen=gen)
    x = _randn(T, K, dtype=torch.bfloat16, gen=gen)
    out = [poisoned((N, K), device="cuda") for _ in range(E)]
    _cutlass.wgrad(dy, x, splits.cuda(), out, False)
    w = [_randn(N, K, dtype=torch.bfloat16, gen=gen) for _ in range(E)]
    y = poisoned((T, N), dtype=torch.bfloat16, device="cuda")
    _cutlass.fprop(x, w, splits.cuda(), y)
    for e, (lo, hi) in enumerate(_bounds(splits.tolist())):
        ref = dy[lo:hi].double().T @ x[lo:hi].double()
        _check(out[e], ref, dy[lo:hi].float().T @ x[lo:hi].float(), f"wgrad expert {e}")
        _check(y[lo:hi], x[lo:hi].double() @ w[e].double().T, x[lo:hi] @ w[e].T, f"fprop {e}")


#: Device splits a host check would reject (E = 5, T = 600): past T, short of it, a negative
#: count with the right sum, a count past T with the right sum, no tokens at all.
MALFORMED = [[600, 600, 0, 0, 0], [100, 0, 0, 0, 100], [650, -50, 0, 0, 0],
             [0, 1200, -600, 0, 0], [0, 0, 0, 0, 0]]  # fmt: skip


@pytest.mark.parametrize("sizes", MALFORMED, ids=str)
def test_malformed_device_splits_give_nan_outputs(sizes: list[int]) -> None:
    """No host check sees a device ``splits``: the setup kernel gives the GEMM no tiles and
    fills every output with NaN — fprop's and dgrad's whole output, every expert's wgrad,
    accumulating or overwriting, packed or listed, over several setup launches too —
    never a finite wrong value; the next well-formed call is exact again."""
    gen = torch.Generator().manual_seed(5)
    E, K, N, T, x, dy, w = _graph_case("fprop", gen)
    bad = torch.tensor(sizes, device="cuda")
    y, dx = torch.zeros(T, N, dtype=torch.bfloat16, device="cuda"), torch.zeros_like(x)
    _cutlass.fprop(x, w, bad, y)
    _cutlass.dgrad(dy, torch.stack(w), bad, dx)
    packed = torch.zeros(E, N, K, device="cuda")
    listed = [torch.zeros(N, K, device="cuda") for _ in range(E)]
    _cutlass.wgrad(dy, x, bad, packed, True)
    _cutlass.wgrad(dy, x, bad, listed, False)
    many = [torch.zeros(8, 8, device="cuda") for _ in range(300)]  # three setup launches
    narrow = [t[:, :8].contiguous() for t in (dy, x)]
    _cutlass.wgrad(*narrow, torch.tensor(sizes + [0] * 295, device="cuda"), many, True)
    for name, got in [("fprop", y), ("dgrad", dx), ("wgrad packed", packed),
                      ("wgrad listed", torch.stack(listed)), ("wgrad, 300", torch.stack(many))]:  # fmt: skip
        assert got.isnan().all(), f"{name}: {int((~got.isnan()).sum())} elements not NaN"
    good = [120] * 5
    _cutlass.fprop(x, w, torch.tensor(good, device="cuda"), y)
    for e, (lo, hi) in enumerate(_bounds(good)):
        _check(y[lo:hi], x[lo:hi].double() @ w[e].double().T, x[lo:hi] @ w[e].T, f"fprop {e}")


# ---------------------------------------------------------------- support checks


def test_fallback_reasons_on_the_device() -> None:
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    w = [torch.randn(128, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    y = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)
    assert tuning.fallback_reason("fprop", x, w, y) is None
    assert tuning.fallback_reason("fprop", x.float(), [t.float() for t in w], y.float()) == (
        "torch.float32 inputs (CUTLASS takes torch.bfloat16 and torch.float16)"
    )
    x_odd = torch.randn(64, 260, device="cuda", dtype=torch.bfloat16)
    w_odd = [torch.randn(128, 260, device="cuda", dtype=torch.bfloat16)]
    assert tuning.fallback_reason("fprop", x_odd, w_odd, y) == "K = 260 is not a multiple of 8"
    flat = torch.randn(1 + 128 * 256, device="cuda", dtype=torch.bfloat16)
    shifted = flat[1:].view(128, 256)
    reason = tuning.fallback_reason("fprop", x, [w[0], shifted], y)
    assert reason == "weights[1] is not 16-byte aligned"
    dw = [torch.empty(128, 256, device="cuda", dtype=torch.float16)]
    assert tuning.fallback_reason("wgrad", y, x, dw) == (
        "no compiled wgrad kernel for torch.bfloat16 inputs with torch.float16 output"
    )
    assert tuning.fallback_reason("wgrad", y, x, [t.float() for t in dw]) is None
    assert _cutlass.unavailable_reason(x.device) is None


def test_cache_dir_argument_beats_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "from_env"))
    explicit = build.build_spec(tmp_path / "explicit", build.VARIANTS)
    default = build.build_spec(None, build.VARIANTS)
    assert explicit.directory.parent == tmp_path / "explicit"
    assert default.directory.parent == tmp_path / "from_env"
    assert explicit.name == default.name  # same sources and flags: same build
