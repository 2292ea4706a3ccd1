"""Tables and plots for the grouped-GEMM benchmark (``bench_kernels.py``).

Every ratio is a speed-up: a baseline's time over ours, measured in the same
run on the same inputs (above 1 means ours is faster).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BASELINES: dict[str, list[tuple[str, str]]] = {
    # op -> [(baseline key, label)]
    "fprop": [("grouped_mm", "vs _grouped_mm"), ("loop", "vs loop"), ("dense", "vs dense")],
    "dgrad": [("grouped_mm", "vs _grouped_mm"), ("loop", "vs loop"), ("dense", "vs dense")],
    "wgrad_bf16": [("grouped_mm", "vs _grouped_mm"), ("loop", "vs loop"), ("dense", "vs dense")],
    "wgrad_fp32_acc": [("grouped_mm_add", "vs _grouped_mm+add"), ("loop_fp32", "vs fp32 loop")],
}

# The targets of every cell (issue 14), by op:
# * fprop, dgrad: >= 1.0x _grouped_mm (>= 1.15x for E >= 64); >= 0.90x dense cuBLAS of the
#   same FLOPs for E <= 32 where the cell's floor is set by its FLOPs;
# * wgrad into fp32 main_grad: >= 1.1x the better of _grouped_mm+add and the fp32 loop;
#   >= 0.85 of the floor where the floor is set by FLOPs.
# A cell's floor: max(FLOPs at the run's dense rate, bytes moved at the run's copy rate).
BEST_OF_BASELINES_TARGET = 1.1
FLOOR_FRACTION_TARGET = 0.85


def shape_of(row: dict) -> dict[str, int]:
    """``E``, ``K``, ``N``, ``T`` of a row, read from its case label."""
    return {k: int(v) for k, v in (part.split("=") for part in row["case"].split()[:4])}


def flop_bound(row: dict, ceilings: dict[str, float]) -> bool:
    """Whether the cell's floor is its FLOPs at the dense rate (not its bytes at the copy rate)."""
    s = shape_of(row)
    if row["op"] == "wgrad_fp32_acc":  # bf16 inputs read, fp32 main_grad read and written
        moved = 2 * s["T"] * (s["N"] + s["K"]) + 8 * s["E"] * s["N"] * s["K"]
    else:  # both bf16 row operands and the bf16 weights (or outputs) once
        moved = 2 * (s["T"] * (s["N"] + s["K"]) + s["E"] * s["N"] * s["K"])
    flop_s = row["flops"] / (ceilings["dense_bf16_tflops"] * 1e12)
    byte_s = moved / (ceilings["copy_gbs"] * 1e9)
    return flop_s >= byte_s


def target(row: dict, key: str, ceilings: dict[str, float]) -> float | None:
    """The speed-up target of one baseline column of a row, or ``None`` when it has none."""
    if row["op"] not in ("fprop", "dgrad"):
        return None
    E = shape_of(row)["E"]
    if key == "grouped_mm":
        return 1.15 if E >= 64 else 1.0
    if key == "dense" and E <= 32 and flop_bound(row, ceilings):
        return 0.90
    return None


def speedups(row: dict) -> dict[str, float]:
    times = row["times_ms"]
    return {key: times[key] / times["ours"] for key, _ in BASELINES[row["op"]]}


def tflops(row: dict) -> float:
    return row["flops"] / (row["times_ms"]["ours"] * 1e-3) / 1e12


def _mark(value: float, target: float | None) -> str:
    if target is None:
        return f"{value:.2f}"
    return f"{value:.2f}" + ("" if value >= target else " (miss)")


def profile_op(row: dict) -> str:
    """The row's op as ``profile_cells.py`` names it (``wgrad_fp32`` for the fp32 wgrad)."""
    return "wgrad_fp32" if row["op"] == "wgrad_fp32_acc" else row["op"]


def misses(row: dict, ceilings: dict[str, float]) -> list[str]:
    """The targets a row misses, by key: a baseline key, ``"better"`` or ``"floor"``."""
    ups = speedups(row)
    missed = [
        key
        for key, _ in BASELINES[row["op"]]
        if (goal := target(row, key, ceilings)) is not None and ups[key] < goal
    ]
    if row["op"] == "wgrad_fp32_acc" and min(ups.values()) < BEST_OF_BASELINES_TARGET:
        missed.append("better")
    floor_fraction = row.get("fraction_of_floor", FLOOR_FRACTION_TARGET)
    if floor_fraction < FLOOR_FRACTION_TARGET and flop_bound(row, ceilings):
        missed.append("floor")
    return missed


def profiled_impls(row: dict, missed: list[str]) -> list[str]:
    """Which implementations of a row ``profile_cells.py`` profiles to explain its misses.

    Always ours; ``_grouped_mm`` for a miss against it; for wgrad into fp32 below
    the better baseline, that baseline (``grouped_mm`` or ``loop``).
    """
    impls = ["ours"]
    if "grouped_mm" in missed:
        impls.append("grouped_mm")
    if "better" in missed:
        ups = speedups(row)
        impls.append("loop" if ups["loop_fp32"] < ups["grouped_mm_add"] else "grouped_mm")
    return impls


def _profile_text(label: str, record: dict) -> str:
    return (
        f"{label} {record['total_ms']:.2f} ms ({record['kernels']} kernels), longest: "
        f"SM {record['sm_throughput_pct']:.0f} %, DRAM {record['dram_throughput_pct']:.0f} %, "
        f"balance {record['sm_balance']:.2f}"
    )


def miss_reason(row: dict, missed: list[str], profiles: list[dict]) -> str:
    """What Nsight Compute measured for a row's misses (``profile_cells.py --summarize``).

    The profiled implementations' times (clocks locked at base), SM and DRAM
    throughput and SM balance of their longest kernel, and the skew facts the
    summary computed from the splits (padded rows of ours' M tiles for fprop
    and dgrad; experts with fewer than 512 tokens for wgrad). Empty when the
    row was not profiled.
    """
    op = profile_op(row)
    by_impl = {r["impl"]: r for r in profiles if r.get("op") == op and r.get("case") == row["case"]}
    if "ours" not in by_impl:
        return ""
    labels = {"ours": "ours", "grouped_mm": "_grouped_mm", "loop": "loop"}
    parts = [
        _profile_text(labels[impl], by_impl[impl])
        for impl in profiled_impls(row, missed)
        if impl in by_impl
    ]
    ours = by_impl["ours"]
    if "padded_rows_pct" in ours:
        parts.append(f"padded rows {ours['padded_rows_pct']:.1f} %")
    if "experts_under_512" in ours:
        parts.append(f"experts under 512 tokens: {ours['experts_under_512']}")
    return "; ".join(parts)


def one_line(row: dict) -> str:
    ratios = ", ".join(f"x{v:.2f} {k}" for k, v in speedups(row).items())
    extra = f", {row['fraction_of_floor']:.2f} of floor" if "fraction_of_floor" in row else ""
    err = row.get("rel_err_vs_grouped_mm", row.get("rel_err_vs_fp32"))
    return (
        f"{row['op']:15s} {row['case']:42s} ours {row['times_ms']['ours']:.3f} ms "
        f"({tflops(row):.0f} TFLOP/s, host {row.get('host_us', float('nan')):.0f} us/call): "
        f"{ratios}{extra} [{row['variant']}, rel err {err:.1e}]"
    )


def markdown_table(result: dict, profiles: list[dict] | None = None) -> str:
    """The result as a markdown table; with ``profiles``, a column says what each miss measured."""
    header = "| op | E, K, N, T | splits | ours ms | TFLOP/s | host µs/call (ours / `_grouped_mm`) | speed-ups (baseline time / ours) | floor fraction |"
    rule = "|---|---|---|---|---|---|---|---|"
    if profiles is not None:
        header += " profile of the misses (Nsight Compute) |"
        rule += "---|"
    lines = [
        f"GPU: {result['gpu']}, torch {result['torch']} (CUDA {result['cuda']}), {result['date']}; "
        f"ceilings measured in the same run: copy {result['ceilings']['copy_gbs']:.0f} GB/s "
        f"(read+write), dense bf16 {result['ceilings']['dense_bf16_tflops']:.0f} TFLOP/s.",
        "",
        header,
        rule,
    ]
    ceilings = result["ceilings"]
    for row in result["rows"]:
        shape, splits = row["case"].rsplit(" ", 1)
        ups = speedups(row)
        ratios = "; ".join(
            f"{label} {_mark(ups[key], target(row, key, ceilings))}"
            for key, label in BASELINES[row["op"]]
        )
        if row["op"] == "wgrad_fp32_acc":
            ratios += f"; vs the better {_mark(min(ups.values()), BEST_OF_BASELINES_TARGET)}"
        floor = ""
        if "fraction_of_floor" in row:
            need = FLOOR_FRACTION_TARGET if flop_bound(row, ceilings) else None
            floor = _mark(row["fraction_of_floor"], need)
        host = f"{row['host_us']:.0f}" if "host_us" in row else ""
        if "host_us_grouped_mm" in row:
            host += f" / {row['host_us_grouped_mm']:.0f}"
        line = (
            f"| {row['op']} | {shape} | {splits} | {row['times_ms']['ours']:.3f} | "
            f"{tflops(row):.0f} | {host} | {ratios} | {floor} |"
        )
        if profiles is not None:
            missed = misses(row, ceilings)
            line += f" {miss_reason(row, missed, profiles) if missed else ''} |"
        lines.append(line)
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in BASELINES if any(r["op"] == op for r in result["rows"])]
    cells = max(sum(r["op"] == op for r in result["rows"]) for op in ops)
    fig, axes = plt.subplots(
        len(ops), 1, figsize=(max(12, 1.1 * cells), 3.6 * len(ops)), squeeze=False
    )
    for ax, op in zip(axes[:, 0], ops, strict=True):
        rows = [r for r in result["rows"] if r["op"] == op]
        baselines = BASELINES[op]
        width = 0.8 / len(baselines)
        for j, (key, label) in enumerate(baselines):
            xs = [i + j * width for i in range(len(rows))]
            values = [speedups(r)[key] for r in rows]
            bars = ax.bar(xs, values, width, label=label)
            color = bars.patches[0].get_facecolor()
            for x, v, row in zip(xs, values, rows, strict=True):
                ax.text(x, v * 1.03, f"{v:.2f}", ha="center", va="bottom", fontsize=6)
                goal = target(row, key, result["ceilings"])
                if goal is not None:  # this cell's target, dashed over its bar
                    ax.hlines(goal, x - width / 2, x + width / 2, colors=color, linestyles="dashed")
        if op == "wgrad_fp32_acc":  # the target is on the better of the two baselines
            for i in range(len(rows)):
                ax.hlines(
                    BEST_OF_BASELINES_TARGET,
                    i - width / 2,
                    i + 1.5 * width,
                    colors="black",
                    linestyles="dashed",
                )
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        labels = [r["case"].replace(" N=", "\nN=").replace(" T=", "\nT=") for r in rows]
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_yscale("log", base=2)
        ax.set_ylabel("speed-up (log scale)")
        ax.set_title(f"{op}: baseline time / ours (dashed: target)", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"groupgrad CUTLASS grouped GEMMs on {result['gpu']} ({result['date'][:10]})", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description="Print a bench_kernels.py result as a table.")
    parser.add_argument("result", type=Path, help="kernels_<gpu>.json")
    parser.add_argument(
        "--profiles", type=Path, help="profile.json of profile_cells.py --summarize"
    )
    args = parser.parse_args()
    result = json.loads(args.result.read_text())
    profiles = json.loads(args.profiles.read_text()) if args.profiles else None
    print(markdown_table(result, profiles))


if __name__ == "__main__":
    main()
