"""One call of one implementation of one benchmark cell, for Nsight Compute to profile.

``bench_kernels.py`` says which cells miss their targets; this script runs one
of them so that ``ncu`` can say why. It builds the cell's inputs exactly as
the benchmark does (same config, split kind and seed), warms the chosen
implementation up outside the profiled window, then runs it once between
``cudaProfilerStart`` and ``cudaProfilerStop``. Profile only that window::

    ncu --profile-from-start off --csv --log-file OUT.csv \\
        --section SpeedOfLight \\
        --metrics sm__cycles_active.avg,sm__cycles_active.max,launch__grid_size \\
        python benchmarks/profile_cells.py --op wgrad_fp32 --config 3 --splits heavy --impl ours

Implementations: ``ours`` (the public API: setup and GEMM kernels),
``grouped_mm`` (``torch._grouped_mm``; for wgrad_fp32 followed by the fp32
add, as the benchmark's baseline) and ``loop`` (the per-expert cuBLAS loop;
fp32 output for wgrad_fp32). ``sm__cycles_active.avg / .max`` is the load
balance across SMs (1 when every SM is busy for as long as the busiest one).

``--missed RESULTS`` prints ``op config splits impl`` for every implementation
to profile so that each missed cell of a ``bench_kernels.py`` result
(``kernels_report.misses``) is explained: ours, and the baseline it missed
against (``kernels_report.profiled_impls``).

``--summarize DIR`` reads the CSV files ``ncu_<op>_<config>_<splits>_<impl>.csv``
there (``--log-file`` names as above), prints one line per file — total GPU
time, and for its longest kernel the time, grid, SM balance and SM and DRAM
throughput — and writes them to ``DIR/profile.json``, with the skew facts of
ours computed from the cell's splits: the padded rows of its M tiles (fprop,
dgrad) or how many experts have fewer than 512 tokens (wgrad).
``python benchmarks/kernels_report.py RESULTS --profiles DIR/profile.json``
prints the result's table with these profiles beside its misses.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernels_report
import kernels_timing as kt
from bench_kernels import CONFIGS

from groupgrad.kernels import grouped_dgrad, grouped_fprop, grouped_wgrad, tuning

OPS = ("fprop", "dgrad", "wgrad_fp32")
IMPLS = ("ours", "grouped_mm", "loop")


def _call(
    op: str, impl: str, E: int, K: int, N: int, T: int, kind: str, seed: int
) -> Callable[[], object]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    splits = kt.splits_for(kind, T, E, seed)
    splits_dev = torch.tensor(splits, device="cuda")
    offs = torch.cumsum(splits_dev, 0).to(torch.int32)
    bounds = [(sum(splits[:e]), sum(splits[: e + 1])) for e in range(E)]
    x = torch.randn(T, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05
    if op == "wgrad_fp32":
        main_grads = [torch.zeros(N, K, device="cuda") for _ in range(E)]
        packed = torch.zeros(E, N, K, device="cuda")
        loop_kind = kt.fp32_addmm_loop_kind()
        return {
            "ours": lambda: grouped_wgrad(dy, x, splits_dev, out=main_grads, accumulate=True),
            "grouped_mm": lambda: packed.add_(torch._grouped_mm(dy.t(), x, offs=offs)),
            "loop": lambda: [
                kt.fp32_accumulate(loop_kind, main_grads[e], dy[lo:hi].t(), x[lo:hi])
                for e, (lo, hi) in enumerate(bounds)
            ],
        }[impl]
    a, out = (x, torch.empty(T, N, device="cuda", dtype=torch.bfloat16)) if op == "fprop" else (
        dy, torch.empty(T, K, device="cuda", dtype=torch.bfloat16))  # fmt: skip
    public = grouped_fprop if op == "fprop" else grouped_dgrad

    def loop() -> None:
        for e, (lo, hi) in enumerate(bounds):
            torch.mm(a[lo:hi], w[e].T if op == "fprop" else w[e], out=out[lo:hi])

    b = w.transpose(-2, -1) if op == "fprop" else w
    return {
        "ours": lambda: public(a, w, splits_dev, out=out),
        "grouped_mm": lambda: torch._grouped_mm(a, b, offs=offs),
        "loop": loop,
    }[impl]


def missed(result: dict) -> list[tuple[str, int, str, str]]:
    """``(op, config index, splits, impl)`` to profile for each missed cell of a result."""
    cells = []
    for row in result["rows"]:
        missed_targets = kernels_report.misses(row, result["ceilings"])
        if not missed_targets:
            continue
        s = kernels_report.shape_of(row)
        config = CONFIGS.index((s["E"], s["K"], s["N"], s["T"]))
        op = kernels_report.profile_op(row)
        kind = row["case"].rsplit(" ", 1)[1]
        cells += [
            (op, config, kind, impl) for impl in kernels_report.profiled_impls(row, missed_targets)
        ]
    return cells


def skew_facts(op: str, config: int, kind: str) -> dict[str, object]:
    """What the cell's splits mean for ours: padded rows of its M tiles, or small experts."""
    E, K, N, T = CONFIGS[config]
    splits = kt.splits_for(kind, T, E, seed=config)
    if op == "wgrad_fp32":
        return {
            "experts_under_512": f"{sum(0 < s < 512 for s in splits)} of {E} (empty: {splits.count(0)})"
        }
    plan = tuning.plan_for(op, torch.bfloat16, torch.bfloat16, T, E, N, K)
    tile_m = next(v.tile[0] for v in tuning.VARIANTS if v.name == plan.variant)
    computed = sum(-(-s // tile_m) * tile_m for s in splits)
    return {"tile_m": tile_m, "padded_rows_pct": 100.0 * (computed - T) / T}


def summarize(folder: Path) -> list[dict]:
    """One record per ``ncu`` CSV file of ``folder``: the call's kernels and its longest one."""
    records = []
    for path in sorted(folder.glob("ncu_*.csv")):
        lines = path.read_text().splitlines()
        header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
        if header is None:  # ncu profiled nothing (the run failed or was cut): say so
            print(f"{path.name}: no profiled kernel")
            continue
        kernels: dict[tuple[str, str, str], dict[str, float]] = {}
        for row in csv.DictReader(lines[header:]):
            key = (row["ID"], row["Kernel Name"], row["Grid Size"])
            value = float(row["Metric Value"].replace(",", ""))
            kernels.setdefault(key, {})[row["Metric Name"]] = value
        (_, name, grid), top = max(kernels.items(), key=lambda kv: kv[1]["gpu__time_duration.sum"])
        cell = path.stem.removeprefix("ncu_")
        impl = next(i for i in IMPLS if cell.endswith(f"_{i}"))
        op, config, kind = cell.removesuffix(f"_{impl}").rsplit("_", 2)
        E, K, N, T = CONFIGS[int(config)]
        facts = skew_facts(op, int(config), kind) if impl == "ours" else {}
        records.append(
            {
                "cell": cell,
                "op": op,
                "case": f"E={E} K={K} N={N} T={T} {kind}",
                "impl": impl,
                "kernels": len(kernels),
                "total_ms": sum(k["gpu__time_duration.sum"] for k in kernels.values()) / 1e6,
                "longest_kernel": name[:120],
                "longest_ms": top["gpu__time_duration.sum"] / 1e6,
                "grid": grid,
                "sm_balance": top["sm__cycles_active.avg"] / top["sm__cycles_active.max"],
                "sm_throughput_pct": top["sm__throughput.avg.pct_of_peak_sustained_elapsed"],
                "dram_throughput_pct": top["dram__throughput.avg.pct_of_peak_sustained_elapsed"],
                **facts,
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=OPS)
    parser.add_argument("--config", type=int, help="index into bench_kernels.CONFIGS")
    parser.add_argument("--splits", choices=kt.SPLIT_KINDS)
    parser.add_argument("--impl", choices=IMPLS)
    parser.add_argument("--summarize", type=Path, help="summarize the ncu CSV files of this folder")
    parser.add_argument("--missed", type=Path, help="list the cells to profile for this result")
    args = parser.parse_args()
    if args.missed is not None:
        for op, config, kind, impl in missed(json.loads(args.missed.read_text())):
            print(op, config, kind, impl)
        return
    if args.summarize is not None:
        records = summarize(args.summarize)
        for r in records:
            print(
                f"{r['cell']:32s} {r['kernels']:4d} kernels {r['total_ms']:7.3f} ms; longest "
                f"{r['longest_ms']:7.3f} ms grid {r['grid']:12s} SM balance {r['sm_balance']:.3f} "
                f"SM {r['sm_throughput_pct']:5.1f} % DRAM {r['dram_throughput_pct']:5.1f} %"
            )
        (args.summarize / "profile.json").write_text(json.dumps(records, indent=1))
        return
    if None in (args.op, args.config, args.splits, args.impl):
        parser.error("--op, --config, --splits and --impl are required to run a cell")
    E, K, N, T = CONFIGS[args.config]
    run = _call(args.op, args.impl, E, K, N, T, args.splits, seed=args.config)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled {args.op} E={E} K={K} N={N} T={T} {args.splits} {args.impl}")


if __name__ == "__main__":
    main()
