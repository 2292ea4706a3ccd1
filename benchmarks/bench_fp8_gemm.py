"""FP8 blockwise grouped GEMMs against their baselines, timed interleaved in one process.

Each cell times, on the same random data (two input sets rotated between calls):

* fprop / dgrad: ours in FP8 (1×128 activations, 128×128 weights, quantized
  beforehand), ours in bf16, cuBLASLt's dense blockwise ``F.scaled_mm`` of the
  same (T, N, K) (one weight for all T rows: the same FLOPs, no grouping), and
  ``torch._scaled_grouped_mm`` rowwise (a different recipe: per-row scales);
* wgrad into fp32 ``main_grad`` (accumulate): ours in FP8 (both operands
  1×128 per expert's 128-token blocks), ours in bf16, and cuBLASLt's dense
  1×128·1×128 ``F.scaled_mm`` per expert (tokens zero-padded to 128, fp32
  out) with and without adding into ``main_grad``.

Cells: the bf16 table's configs under its three routings (uniform, mild,
heavy), and DeepGEMM's wgrad shapes (E ∈ {4, 8, 16}, (N, K) ∈ {(4096, 7168),
(7168, 2048)}, 4,096 tokens per expert or U[4096, 8192]). The quantizers'
own time is in ``bench_fp8_quant.py``. Writes ``results/fp8_gemm_<gpu>.json``
and ``.png`` and prints the markdown table (``fp8_report.py``). Usage:
``python benchmarks/bench_fp8_gemm.py [--reps 20] [--quick]``.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Callable
from pathlib import Path

import fp8_report
import kernels_timing as kt
import torch
import torch.nn.functional as F

from groupgrad.kernels import (
    Fp8Blocks,
    grouped_dgrad,
    grouped_fprop,
    grouped_wgrad,
    quantize_fp8,
    tuning,
)

ROWS, WEIGHTS, SEGMENTS = (1, 128), (128, 128), (128, 1)
CONFIGS = [  # (E, K, N, T): the bf16 table's (bench_kernels.CONFIGS)
    (8, 4096, 28672, 16384),
    (8, 7168, 4096, 32768),
    (128, 2048, 1536, 32768),
    (32, 2048, 7168, 65536),
    (64, 2048, 2816, 32768),
]
DEEPGEMM_WGRAD = [(E, N, K) for E in (4, 8, 16) for N, K in ((4096, 7168), (7168, 2048))]
N_SETS = 2
_SWEEP: dict[str, list[str]] = {}  # op -> FP8 tuning variants to time beside ours (--tuning)
#: Tile orders (max_swizzle, along N) timed for the shipped kernel (--orders); the ops run (1, M).
ORDERS = [(1, True), (2, False), (4, False), (8, False), (2, True), (4, True), (8, True)]
_ORDERS: list[tuple[int, bool]] = []
#: The shipped fp32 wgrad kernel that accumulates by loading C (the one overwrites run),
#: timed beside the one that adds by TMA reduce-add (which large experts' accumulation runs).
_LOADS_C = tuning.fp8_variant_for("wgrad", torch.float32)


def _time_orders(
    fns: dict[str, Callable[[int], object]], shipped: str, run: Callable[[int, int, bool], object]
) -> None:
    """Add ``run(i, max_swizzle, raster_along_n)`` of the shipped kernel in each of ``_ORDERS``."""
    for swizzle, along_n in _ORDERS:
        fns[f"sweep:{shipped}_s{swizzle}{'n' if along_n else 'm'}"] = (
            lambda i, s=swizzle, n=along_n: run(i, s, n)
        )


def _randn(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda").bfloat16()


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------- baselines


def _blockwise_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                  b_kind: str, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """cuBLASLt's blockwise ``scaled_mm``: ``a`` 1×128, ``b`` 128×128 or 1×128 (``b_kind``)."""
    bw = F.ScalingType.BlockWise1x128
    kind = bw if b_kind == "1x128" else F.ScalingType.BlockWise128x128
    return F.scaled_mm(a, b, sa, bw, sb, kind, output_dtype=out_dtype)


def _pick_scale_form(fn: Callable[[torch.Tensor], torch.Tensor], forms: dict[str, torch.Tensor],
                     truth: torch.Tensor) -> tuple[str | None, float]:  # fmt: skip
    """The first scale form with which ``fn`` matches ``truth`` (cuBLASLt's layouts moved between
    torch releases), and its relative error."""
    for name, scale in forms.items():
        try:
            got = fn(scale)
        except Exception as error:  # another form may be the one this torch takes
            print(f"  scaled_mm scale form {name}: {type(error).__name__}: {str(error)[:160]}")
            continue
        rel = kt.rel_error(got.float(), truth)
        if rel < 1e-2:
            return name, rel
    return None, float("nan")


def _dense_rows(op: str, a8: Fp8Blocks, w8: Fp8Blocks, truth: torch.Tensor):
    """cuBLASLt's dense blockwise product of all T rows with expert 0's weight, or ``None``."""
    a, sa = a8.data, a8.scales
    b = w8.data[0].t() if op == "fprop" else w8.data_t[0].t()  # type: ignore[index]
    s = w8.scales[0]  # (N/128, K/128) of w_e (N, K)
    forms = {  # cuBLASLt reads B's 128x128 scales as (its K/128, its N/128), strides vary
        "s.t()": s.t(), "s.t() column-major": s.t().contiguous().t(), "s": s,
        "s column-major": s.contiguous().t().contiguous().t(),
    }  # fmt: skip
    name, _ = _pick_scale_form(
        lambda s: _blockwise_mm(a, sa, b, s, "128x128", torch.bfloat16), forms, truth
    )
    if name is None:
        return None
    sb = forms[name]
    return lambda: _blockwise_mm(a, sa, b, sb, "128x128", torch.bfloat16)


def _scaled_grouped_rowwise(
    x: torch.Tensor, w: torch.Tensor, splits: list[int], want: torch.Tensor
):
    """``torch._scaled_grouped_mm`` rowwise (per-row / per-column scales), or ``None`` when it
    fails or misses ``want`` (our bf16 result) by more than FP8's rounding."""
    try:
        x8 = x.to(torch.float8_e4m3fn)
        w8 = w.to(torch.float8_e4m3fn).transpose(-2, -1)  # (E, K, N), column-major per expert
        sx = torch.ones(x.shape[0], device="cuda")
        sw = torch.ones(w.shape[0], w.shape[1], device="cuda")
        offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)

        def run() -> torch.Tensor:
            return torch._scaled_grouped_mm(
                x8, w8, sx, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
            )

        rel = kt.rel_error(run().float(), want.float())
        print(f"  _scaled_grouped_mm rowwise: rel error {rel:.2e} against bf16")
        return run if rel < 0.1 else None
    except Exception as error:  # absent or refusing this shape: reported, not fatal
        print(f"  _scaled_grouped_mm: {type(error).__name__}: {str(error)[:160]}")
        return None


# --------------------------------------------------------------------------- cells


def bench_rows(op: str, E: int, K: int, N: int, T: int, kind: str, reps: int, seed: int) -> dict:
    splits = kt.splits_for(kind, T, E, seed)
    dev = torch.tensor(splits, device="cuda")
    cols, width = (K, N) if op == "fprop" else (N, K)
    a = [_randn(T, cols, seed=seed + i) for i in range(N_SETS)]
    w = [_randn(E, N, K, seed=seed + 10 + i) * 0.05 for i in range(N_SETS)]
    a8 = [quantize_fp8(t, block=ROWS) for t in a]
    w8 = [quantize_fp8(t, block=WEIGHTS) for t in w]
    out = torch.empty(T, width, device="cuda", dtype=torch.bfloat16)
    gemm = grouped_fprop if op == "fprop" else grouped_dgrad
    fns: dict[str, Callable[[int], object]] = {
        "fp8": lambda i: gemm(a8[i], w8[i], dev, out=out),
        "bf16": lambda i: gemm(a[i], w[i], dev, out=out),
    }
    w0 = w8[0].dequantize()[0]  # type: ignore[index]
    dense = _dense_rows(op, a8[0], w8[0], a8[0].dequantize() @ (w0.T if op == "fprop" else w0))
    if dense is not None:
        fns["cublaslt_dense"] = lambda i: dense()
    for name in _SWEEP.get(op, ()):
        fns[f"sweep:{name}"] = lambda i, name=name: tuning.run_fp8_cutlass(
            op, a8[i], w8[i], dev, out, variant=name
        )
    shipped = tuning.fp8_variant_for(op, torch.bfloat16)
    _time_orders(
        fns,
        shipped,
        lambda i, s, n: tuning.run_fp8_cutlass(
            op, a8[i], w8[i], dev, out, variant=shipped, max_swizzle=s, raster_along_n=n
        ),
    )
    if op == "fprop":
        want = grouped_fprop(a[0], w[0], dev)
        rowwise = _scaled_grouped_rowwise(a[0], w[0], splits, want)
        if rowwise is not None:
            fns["scaled_grouped_rowwise"] = lambda i: rowwise()
    ms = kt.interleaved_ms(fns, N_SETS, rounds=4, per_round=max(1, reps // 4))
    flops = 2.0 * T * N * K
    return {"op": op, "E": E, "K": K, "N": N, "T": T, "splits": kind,
           **{f"{k}_ms": v for k, v in ms.items()},
           **{f"{k}_tflops": _tflops(flops, v) for k, v in ms.items()}}  # fmt: skip


def bench_wgrad(E: int, N: int, K: int, splits: list[int], label: str, reps: int, seed: int,
                floor_rates: dict[str, float]) -> dict:  # fmt: skip
    T = sum(splits)
    dev = torch.tensor(splits, device="cuda")
    dy = [_randn(T, N, seed=seed + i) for i in range(N_SETS)]
    x = [_randn(T, K, seed=seed + 5 + i) for i in range(N_SETS)]
    dy8 = [quantize_fp8(t, block=SEGMENTS, splits=dev) for t in dy]
    x8 = [quantize_fp8(t, block=SEGMENTS, splits=dev) for t in x]
    main_grad = torch.zeros(E, N, K, device="cuda")
    listed = list(main_grad.unbind(0))
    fns: dict[str, Callable[[int], object]] = {
        "fp8": lambda i: grouped_wgrad(dy8[i], x8[i], dev, out=main_grad, accumulate=True),
        "fp8_listed": lambda i: grouped_wgrad(dy8[i], x8[i], dev, out=listed, accumulate=True),
        "bf16": lambda i: grouped_wgrad(dy[i], x[i], dev, out=main_grad, accumulate=True),
    }
    for name in (_LOADS_C, *_SWEEP.get("wgrad", ())):
        fns[f"sweep:{name}"] = lambda i, name=name: tuning.run_fp8_cutlass(
            "wgrad", dy8[i], x8[i], dev, main_grad, variant=name, accumulate=True
        )
    shipped = tuning.fp8_variant_for(
        "wgrad", torch.float32, accumulate=True, tokens_per_expert=T / E
    )

    def wgrad_in_order(i: int, swizzle: int, along_n: bool) -> None:
        tuning.run_fp8_cutlass(
            "wgrad", dy8[i], x8[i], dev, main_grad, variant=shipped, accumulate=True,
            max_swizzle=swizzle, raster_along_n=along_n,
        )  # fmt: skip

    _time_orders(fns, shipped, wgrad_in_order)
    # cuBLASLt per expert: its operands padded to 128 tokens (it needs whole blocks)
    starts = [sum(splits[:e]) for e in range(E)]
    per_expert = []
    for e in range(E):
        t_e = -(-splits[e] // 128) * 128
        if t_e == 0:
            continue
        a = torch.zeros(t_e, N, device="cuda", dtype=torch.bfloat16)
        b = torch.zeros(t_e, K, device="cuda", dtype=torch.bfloat16)
        rows = slice(starts[e], starts[e] + splits[e])
        a[: splits[e]], b[: splits[e]] = dy[0][rows], x[0][rows]
        qa = quantize_fp8(a.t().contiguous(), block=ROWS)
        qb = quantize_fp8(b.t().contiguous(), block=ROWS)
        per_expert.append((e, qa.data, qa.scales, qb.data.t(), qb.scales))
    picked = None
    if per_expert:
        e, qa, sa, qb, sb = per_expert[0]
        a32 = qa.float() * sa.repeat_interleave(128, 1)
        truth = a32 @ (qb.float() * sb.t().repeat_interleave(128, 0))
        forms = {"(K, blocks)": sb, "(blocks, K)": sb.t().contiguous()}
        picked, _ = _pick_scale_form(
            lambda s: _blockwise_mm(qa, sa, qb, s, "1x128", torch.float32), forms, truth
        )
    if picked is not None:
        prepared = [(e, qa, sa, qb, sb if picked == "(K, blocks)" else sb.t().contiguous())
                    for e, qa, sa, qb, sb in per_expert]  # fmt: skip

        def loop(i: int, add: bool) -> None:
            for e, qa, sa, qb, sb in prepared:
                product = _blockwise_mm(qa, sa, qb, sb, "1x128", torch.float32)
                if add:
                    main_grad[e].add_(product)

        fns["cublaslt_loop"] = lambda i: loop(i, False)
        fns["cublaslt_loop_add"] = lambda i: loop(i, True)
    ms = kt.interleaved_ms(fns, N_SETS, rounds=4, per_round=max(1, reps // 4))
    flops = 2.0 * T * N * K
    floor_ms = max(flops / (floor_rates["fp8_1x128_tflops"] * 1e12),
                   2 * main_grad.numel() * 4 / (floor_rates["copy_gbs"] * 1e9)) * 1e3  # fmt: skip
    return {"op": "wgrad_fp32", "E": E, "K": K, "N": N, "T": T, "splits": label,
            "floor_ms": floor_ms,
            **{f"{k}_ms": v for k, v in ms.items()},
            **{f"{k}_tflops": _tflops(flops, v) for k, v in ms.items()}}  # fmt: skip


def deepgemm_cells() -> list[tuple[int, int, int, str, list[int]]]:
    """``(E, N, K, label, splits)`` of DeepGEMM's wgrad shapes: 4,096 tokens per expert, or
    U[4096, 8192] (drawn from seed 0, one draw per cell, so every benchmark gets the same)."""
    gen = torch.Generator().manual_seed(0)
    cells = []
    for E, N, K in DEEPGEMM_WGRAD:
        for label in ("uniform 4096", "U[4096, 8192]"):
            ragged = torch.randint(4096, 8193, (E,), generator=gen).tolist()
            cells.append((E, N, K, label, [4096] * E if label.startswith("uniform") else ragged))
    return cells


def _dense_fp8_1x128_tflops(size: int = 8192) -> float:
    """cuBLASLt's dense 1×128·1×128 blockwise rate on random data (the wgrad floor's rate)."""
    a = quantize_fp8(_randn(size, size, seed=1), block=ROWS)
    b = quantize_fp8(_randn(size, size, seed=2), block=ROWS)
    for sb in (b.scales, b.scales.t().contiguous()):
        try:

            def product(i: int, sb: torch.Tensor = sb) -> torch.Tensor:
                return _blockwise_mm(a.data, a.scales, b.data.t(), sb, "1x128", torch.float32)

            return _tflops(2.0 * size**3, kt.median_ms(product, 1, 10))
        except Exception:  # the other scale layout
            continue
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--quick", action="store_true", help="uniform and heavy routing only, DeepGEMM's E = 4, 8"
    )
    parser.add_argument("--tuning", action="store_true", help="also time the FP8 tuning variants")
    parser.add_argument(
        "--orders", action="store_true", help="also time the shipped kernels in other tile orders"
    )
    parser.add_argument(
        "--ops", nargs="+", choices=("fprop", "dgrad", "wgrad"), default=["fprop", "dgrad", "wgrad"]
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm.py needs a CUDA GPU")
    if args.tuning:
        tuning.build(variant_set="tuning")
        for v in tuning.VARIANT_SETS["tuning"]:
            if v.name.startswith("fp8_") and v.dtype_out in ("f32", "bf16"):
                _SWEEP.setdefault(v.op, []).append(v.name)
    if args.orders:
        _ORDERS.extend(ORDERS)
    rates = {"copy_gbs": kt.copy_bandwidth_gbs(), "fp8_1x128_tflops": _dense_fp8_1x128_tflops()}
    print(f"ceilings: {rates}", flush=True)
    kinds = ("uniform", "heavy") if args.quick else kt.SPLIT_KINDS
    rows = []
    for index, (E, K, N, T) in enumerate(CONFIGS):
        for kind in kinds:
            for op in ("fprop", "dgrad"):
                if op in args.ops:
                    rows.append(bench_rows(op, E, K, N, T, kind, args.reps, seed=index))
                    print(json.dumps(rows[-1]), flush=True)
            if "wgrad" not in args.ops:
                continue
            splits = kt.splits_for(kind, T, E, index)
            rows.append(bench_wgrad(E, N, K, splits, kind, args.reps, 100 + index, rates))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    for E, N, K, label, splits in deepgemm_cells() if "wgrad" in args.ops else ():
        if args.quick and E == 16:
            continue
        tag = f"deepgemm {label}"
        rows.append(bench_wgrad(E, N, K, splits, tag, args.reps, 200 + E, rates))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "ceilings": rates, "reps": args.reps, "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "fp8_gemm_" + gpu.lower().replace("nvidia ", "").replace(" ", "_")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    fp8_report.plot(result, args.out / f"{stem}.png")
    print(fp8_report.markdown(result))


if __name__ == "__main__":
    main()
