"""Benchmark the CUTLASS grouped GEMMs of groupgrad.kernels on one GPU (H100/H200).

For each config (E, K, N, T) and each split distribution (uniform, mild and heavy
skew: ``kernels_timing.splits_for``) it times, on the same random inputs in the same run:

"Ours" is the public API (``grouped_fprop`` etc.: validation, dispatch, launch) with
device splits: packed ``(E, N, K)`` weights and bf16 outputs, and each expert's own
fp32 ``main_grad`` (a list of separate allocations) for the fp32 wgrad. Every row
also records ``host_us``, the CPU time per call of ours (calls enqueued back to back),
and the bf16 rows ``host_us_grouped_mm``, the same for ``torch._grouped_mm`` (one
C++ op: a yardstick of the host's own speed, measured in the same run).

* fprop ``y_e = x_e @ w_e.T`` and dgrad ``dx_e = dy_e @ w_e``: ours, ``torch._grouped_mm``,
  a per-expert cuBLAS loop, and one dense cuBLAS matmul of the same FLOPs;
* wgrad ``dw_e = dy_e.T @ x_e`` into bf16: ours, ``torch._grouped_mm``, the loop, dense;
* wgrad accumulated into an fp32 ``main_grad``: ours (epilogue D = C + AB in fp32),
  ``torch._grouped_mm`` (bf16) followed by ``main_grad.add_``, a per-expert fp32-output
  cuBLAS loop, and the floor max(FLOPs at the dense rate, fp32 read+write at the copy rate).

Ceilings (copy bandwidth, dense bf16 rate) are measured first in the same run.
Writes ``kernels_<gpu>.json`` and ``kernels_<gpu>.png`` into ``--out`` and prints a
markdown table. ``--tuning`` also builds and times the extra tile configurations
(kernels/NOTES.md). Usage: ``python benchmarks/bench_kernels.py --out benchmarks/results``.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernels_report
import kernels_timing as kt

from groupgrad.kernels import grouped_dgrad, grouped_fprop, grouped_wgrad, tuning

CONFIGS = [
    (8, 4096, 28672, 16384),
    (8, 7168, 4096, 32768),
    (128, 2048, 1536, 32768),
    (32, 2048, 7168, 65536),
    (64, 2048, 2816, 32768),  # held out: never used to choose tiles (DeepSeek-V2-Lite's fc1)
]
N_SETS = 2  # input sets rotated between calls


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """What the tuning sweep (``--tuning``) times beside the headline of each row.

    Attributes:
        rounds: interleaved rounds (``--sweep-rounds``).
        all_orders: every variant in raster M/N x swizzle 1/4; else raster M,
            swizzle 1 only (``--sweep-default-order``).
        match: only variants whose name this regular expression finds
            (``--sweep-match``); ``None`` sweeps every compiled one.
    """

    rounds: int = 4
    all_orders: bool = True
    match: re.Pattern[str] | None = None


@dataclasses.dataclass
class Case:
    E: int
    K: int
    N: int
    T: int
    split_kind: str
    splits: list[int]
    x: list[torch.Tensor]  # (T, K) bf16, one per set
    dy: list[torch.Tensor]  # (T, N)
    w: list[torch.Tensor]  # (E, N, K)
    splits_dev: torch.Tensor  # int64
    offs: torch.Tensor  # int32 cumulative, for torch._grouped_mm

    @property
    def flops(self) -> float:
        return 2.0 * self.T * self.N * self.K

    @property
    def label(self) -> str:
        return f"E={self.E} K={self.K} N={self.N} T={self.T} {self.split_kind}"

    def bounds(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for s in self.splits:
            out.append((start, start + s))
            start += s
        return out


def make_case(E: int, K: int, N: int, T: int, split_kind: str, seed: int) -> Case:
    splits = kt.splits_for(split_kind, T, E, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)

    splits_dev = torch.tensor(splits, device="cuda", dtype=torch.int64)
    return Case(
        E,
        K,
        N,
        T,
        split_kind,
        splits,
        [randn(T, K) for _ in range(N_SETS)],
        [randn(T, N) for _ in range(N_SETS)],
        [randn(E, N, K) * 0.05 for _ in range(N_SETS)],
        splits_dev,
        torch.cumsum(splits_dev, 0).to(torch.int32),
    )


def _candidates(op: str, dout: str, spec: SweepSpec | None) -> list[tuning.Plan]:
    """Tuning sweep: the compiled bf16 variants of this op that ``spec`` names, in its orders."""
    if spec is None:
        return []
    names = tuning.compiled_variants()
    orders = 2 if spec.all_orders else 1
    plans = []
    for v in tuning.VARIANTS + tuning.TUNING_VARIANTS:
        if v.op != op or v.dtype_in != "bf16" or v.dtype_out != dout or v.name not in names:
            continue
        if spec.match and not spec.match.search(v.name):
            continue
        for raster_n in (False, True)[:orders]:
            plans += [tuning.Plan(v.name, raster_n, s) for s in (1, 4)[:orders]]
    return plans


def _plan_tag(plan: tuning.Plan) -> str:
    return f"{plan.variant}/{'N' if plan.raster_along_n else 'M'}/s{plan.max_swizzle}"


def _run_plan(run: Callable[[int, tuning.Plan | None], None], plan: tuning.Plan, i: int) -> None:
    run(i, plan)


def _measure(
    headline: Mapping[str, Callable[[int], object]],
    run: Callable[[int, tuning.Plan | None], None],
    plans: list[tuning.Plan],
    reps: int,
    spec: SweepSpec | None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Interleaved timings of ours and the baselines, then of the sweep's plans."""
    times = kt.interleaved_ms(headline, N_SETS, rounds=max(1, reps // 3), per_round=3)
    if not plans or spec is None:
        return times, {}
    sweep_fns: dict[str, Callable[[int], object]] = {
        _plan_tag(p): functools.partial(_run_plan, run, p) for p in plans
    }
    return times, kt.interleaved_ms(sweep_fns, N_SETS, rounds=spec.rounds, per_round=2)


def _row(
    op: str,
    case: Case,
    plan: tuning.Plan,
    times: dict,
    sweep: dict,
    ours: Callable[[int], object],
    **extra: object,
) -> dict:
    return {
        "op": op,
        "case": case.label,
        "flops": case.flops,
        "variant": _plan_tag(plan),
        "times_ms": times,
        "host_us": kt.host_us(ours, N_SETS),
        "sweep_ms": sweep,
        **extra,
    }


def _bf16_row(
    op: str,
    case: Case,
    plan: tuning.Plan,
    out: torch.Tensor,
    headline: Mapping[str, Callable[[int], object]],
    run: Callable[[int, tuning.Plan | None], None],
    plans: list[tuning.Plan],
    reps: int,
    spec: SweepSpec | None,
) -> dict:
    """One bf16 row: ours (``headline["ours"]``, writing ``out``) checked against
    ``headline["grouped_mm"]``, then timed with the baselines and the sweep's plans."""
    ours = headline["ours"]
    ours(0)
    err = kt.rel_error(out, headline["grouped_mm"](0))  # type: ignore[arg-type]
    times, swept = _measure(headline, run, plans, reps, spec)
    host_grouped_mm = kt.host_us(headline["grouped_mm"], N_SETS)  # the same host's yardstick
    return _row(
        op,
        case,
        plan,
        times,
        swept,
        ours,
        rel_err_vs_grouped_mm=err,
        host_us_grouped_mm=host_grouped_mm,
    )


def bench_fprop_dgrad(case: Case, op: str, reps: int, spec: SweepSpec | None) -> dict:
    cols_out = case.N if op == "fprop" else case.K
    a = case.x if op == "fprop" else case.dy
    w_views = [list(w.unbind(0)) for w in case.w]
    out = torch.empty(case.T, cols_out, device="cuda", dtype=torch.bfloat16)
    public = grouped_fprop if op == "fprop" else grouped_dgrad
    plan = tuning.plan_for(op, torch.bfloat16, torch.bfloat16, case.T, case.E, case.N, case.K)

    def ours(i: int) -> None:
        public(a[i], case.w[i], case.splits_dev, out=out)

    def sweep(i: int, p: tuning.Plan | None = None) -> None:
        tuning.run_cutlass(op, a[i], case.w[i], case.splits_dev, out, plan=p)

    def grouped_mm(i: int) -> torch.Tensor:
        b = case.w[i].transpose(-2, -1) if op == "fprop" else case.w[i]
        return torch._grouped_mm(a[i], b, offs=case.offs)

    def loop(i: int) -> None:
        for e, (lo, hi) in enumerate(case.bounds()):
            w_e = w_views[i][e]
            torch.mm(a[i][lo:hi], w_e.T if op == "fprop" else w_e, out=out[lo:hi])

    def dense(i: int) -> torch.Tensor:  # one (N, K) weight for all T rows: the same FLOPs
        w_NK = case.w[i][0]
        return a[i] @ (w_NK.T if op == "fprop" else w_NK)

    headline = {"ours": ours, "grouped_mm": grouped_mm, "loop": loop, "dense": dense}
    plans = _candidates(op, "bf16", spec)
    return _bf16_row(op, case, plan, out, headline, sweep, plans, reps, spec)


def bench_wgrad_bf16(case: Case, reps: int, spec: SweepSpec | None) -> dict:
    out = torch.empty(case.E, case.N, case.K, device="cuda", dtype=torch.bfloat16)
    out_views = list(out.unbind(0))
    plan = tuning.plan_for("wgrad", torch.bfloat16, torch.bfloat16, case.T, case.E, case.N, case.K)

    def ours(i: int) -> None:
        grouped_wgrad(case.dy[i], case.x[i], case.splits_dev, out=out)

    def sweep(i: int, p: tuning.Plan | None = None) -> None:
        tuning.run_cutlass("wgrad", case.dy[i], case.x[i], case.splits_dev, out, plan=p)

    def grouped_mm(i: int) -> torch.Tensor:
        return torch._grouped_mm(case.dy[i].t(), case.x[i], offs=case.offs)

    def loop(i: int) -> None:
        for e, (lo, hi) in enumerate(case.bounds()):
            torch.mm(case.dy[i][lo:hi].t(), case.x[i][lo:hi], out=out_views[e])

    def dense(i: int) -> torch.Tensor:  # (N, T) @ (T, K): the same FLOPs
        return case.dy[i].t() @ case.x[i]

    headline = {"ours": ours, "grouped_mm": grouped_mm, "loop": loop, "dense": dense}
    plans = _candidates("wgrad", "bf16", spec)
    return _bf16_row("wgrad_bf16", case, plan, out, headline, sweep, plans, reps, spec)


def bench_wgrad_fp32(
    case: Case, reps: int, spec: SweepSpec | None, loop_kind: str, ceilings: dict[str, float]
) -> dict:
    # Each expert's own fp32 main_grad (separate allocations, as a framework would hold them).
    main_grads = [torch.zeros(case.N, case.K, device="cuda") for _ in range(case.E)]
    packed_main_grad = torch.zeros(case.E, case.N, case.K, device="cuda")
    plan = tuning.plan_for("wgrad", torch.bfloat16, torch.float32, case.T, case.E, case.N, case.K)

    def ours(i: int) -> None:
        grouped_wgrad(case.dy[i], case.x[i], case.splits_dev, out=main_grads, accumulate=True)

    def sweep(i: int, p: tuning.Plan | None = None) -> None:
        tuning.run_cutlass(
            "wgrad", case.dy[i], case.x[i], case.splits_dev, main_grads, accumulate=True, plan=p
        )

    def grouped_mm_add(i: int) -> None:
        packed_main_grad.add_(torch._grouped_mm(case.dy[i].t(), case.x[i], offs=case.offs))

    def loop(i: int) -> None:
        for e, (lo, hi) in enumerate(case.bounds()):
            kt.fp32_accumulate(loop_kind, main_grads[e], case.dy[i][lo:hi].t(), case.x[i][lo:hi])

    # Correctness on set 0: one accumulation onto a random start, against fp32 cuBLAS.
    start = [torch.randn(case.N, case.K, device="cuda") for _ in range(case.E)]
    for m, s in zip(main_grads, start, strict=True):
        m.copy_(s)
    ours(0)
    ref = [
        start[e] + case.dy[0][lo:hi].float().t() @ case.x[0][lo:hi].float()
        for e, (lo, hi) in enumerate(case.bounds())
    ]
    err = kt.rel_error(main_grads, ref)
    del start, ref
    headline = {"ours": ours, "grouped_mm_add": grouped_mm_add, "loop_fp32": loop}
    plans = _candidates("wgrad", "f32", spec)
    times, swept = _measure(headline, sweep, plans, reps, spec)
    bytes_rw = 2 * case.E * case.N * case.K * 4
    floor_ms = 1e3 * max(
        case.flops / (ceilings["dense_bf16_tflops"] * 1e12),
        bytes_rw / (ceilings["copy_gbs"] * 1e9),
    )
    return _row(
        "wgrad_fp32_acc",
        case,
        plan,
        times,
        swept,
        ours,
        rel_err_vs_fp32=err,
        floor_ms=floor_ms,
        fraction_of_floor=floor_ms / times["ours"],
        loop_kind=loop_kind,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--reps", type=int, default=30, help="timed calls per measurement (median)")
    parser.add_argument("--tuning", action="store_true", help="also sweep every compiled variant")
    parser.add_argument("--sweep-rounds", type=int, default=4, help="rounds of the sweep")
    parser.add_argument(
        "--sweep-default-order",
        action="store_true",
        help="sweep each variant in raster M, swizzle 1 only (not raster M/N x swizzle 1/4)",
    )
    parser.add_argument(
        "--sweep-match",
        type=re.compile,
        default=None,
        help="sweep only the variants whose name this regular expression finds",
    )
    parser.add_argument("--configs", type=str, default="", help="indices into CONFIGS, e.g. 0,2")
    parser.add_argument("--ops", type=str, default="fprop,dgrad,wgrad_bf16,wgrad_fp32")
    parser.add_argument(
        "--splits", type=str, default=",".join(kt.SPLIT_KINDS), help="split kinds (default: all)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")

    _, build_s, compiled = tuning.build()
    print(
        f"extension ready in {build_s:.1f} s ({'compiled' if compiled else 'cached'})", flush=True
    )
    spec = None
    if args.tuning:
        try:
            tuning.build(variant_set="tuning")
            spec = SweepSpec(args.sweep_rounds, not args.sweep_default_order, args.sweep_match)
        except Exception as error:  # the sweep is optional; report and go on without it
            print(f"tuning variants unavailable: {error}", flush=True)
    ceilings = {"copy_gbs": kt.copy_bandwidth_gbs(), "dense_bf16_tflops": kt.dense_bf16_tflops()}
    print(
        f"ceilings: copy {ceilings['copy_gbs']:.0f} GB/s, dense bf16 "
        f"{ceilings['dense_bf16_tflops']:.0f} TFLOP/s",
        flush=True,
    )
    loop_kind = kt.fp32_addmm_loop_kind()
    ops = set(args.ops.split(","))
    picks = [int(i) for i in args.configs.split(",")] if args.configs else range(len(CONFIGS))
    rows = []
    for index in picks:
        E, K, N, T = CONFIGS[index]
        for split_kind in args.splits.split(","):
            case = make_case(E, K, N, T, split_kind, seed=index)
            if "fprop" in ops:
                rows.append(bench_fprop_dgrad(case, "fprop", args.reps, spec))
            if "dgrad" in ops:
                rows.append(bench_fprop_dgrad(case, "dgrad", args.reps, spec))
            if "wgrad_bf16" in ops:
                rows.append(bench_wgrad_bf16(case, args.reps, spec))
            if "wgrad_fp32" in ops:
                rows.append(bench_wgrad_fp32(case, args.reps, spec, loop_kind, ceilings))
            for row in rows[-len(ops) :]:
                print(kernels_report.one_line(row), flush=True)
            del case
            torch.cuda.empty_cache()

    gpu = torch.cuda.get_device_name()
    result = {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "build_seconds": build_s,
        "compiled_now": compiled,
        "ceilings": ceilings,
        "reps": args.reps,
        "n_sets": N_SETS,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "kernels_" + gpu.lower().replace("nvidia ", "").replace(" ", "_")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    kernels_report.plot(result, args.out / f"{stem}.png")
    print(kernels_report.markdown_table(result))


if __name__ == "__main__":
    main()
