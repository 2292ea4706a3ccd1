"""Tables and plots for the grouped-GEMM benchmark (``bench_kernels.py``).

Every ratio is a speed-up: a baseline's time over ours, measured in the same
run on the same inputs (above 1 means ours is faster).
"""

from __future__ import annotations

from pathlib import Path

BASELINES: dict[str, list[tuple[str, str, float | None]]] = {
    # op -> [(baseline key, label, target speed-up or None)]
    "fprop": [
        ("grouped_mm", "vs _grouped_mm", 1.10),
        ("loop", "vs loop", None),
        ("dense", "vs dense", 0.95),
    ],
    "dgrad": [
        ("grouped_mm", "vs _grouped_mm", 1.10),
        ("loop", "vs loop", None),
        ("dense", "vs dense", 0.95),
    ],
    "wgrad_bf16": [
        ("grouped_mm", "vs _grouped_mm", None),
        ("loop", "vs loop", None),
        ("dense", "vs dense", None),
    ],
    "wgrad_fp32_acc": [
        ("grouped_mm_add", "vs _grouped_mm+add", 1.6),
        ("loop_fp32", "vs fp32 loop", 1.15),
    ],
}


def speedups(row: dict) -> dict[str, float]:
    times = row["times_ms"]
    return {key: times[key] / times["ours"] for key, _, _ in BASELINES[row["op"]]}


def tflops(row: dict) -> float:
    return row["flops"] / (row["times_ms"]["ours"] * 1e-3) / 1e12


def _mark(value: float, target: float | None) -> str:
    if target is None:
        return f"{value:.2f}"
    return f"{value:.2f}" + ("" if value >= target else " (miss)")


def one_line(row: dict) -> str:
    ratios = ", ".join(f"x{v:.2f} {k}" for k, v in speedups(row).items())
    extra = f", {row['fraction_of_floor']:.2f} of floor" if "fraction_of_floor" in row else ""
    err = row.get("rel_err_vs_grouped_mm", row.get("rel_err_vs_fp32"))
    return (
        f"{row['op']:15s} {row['case']:42s} ours {row['times_ms']['ours']:.3f} ms "
        f"({tflops(row):.0f} TFLOP/s, host {row.get('host_us', float('nan')):.0f} us/call): "
        f"{ratios}{extra} [{row['variant']}, rel err {err:.1e}]"
    )


def markdown_table(result: dict) -> str:
    lines = [
        f"GPU: {result['gpu']}, torch {result['torch']} (CUDA {result['cuda']}), {result['date']}; "
        f"ceilings measured in the same run: copy {result['ceilings']['copy_gbs']:.0f} GB/s "
        f"(read+write), dense bf16 {result['ceilings']['dense_bf16_tflops']:.0f} TFLOP/s.",
        "",
        "| op | E, K, N, T | splits | ours ms | TFLOP/s | host µs/call | speed-ups (baseline time / ours) | floor fraction |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        shape, splits = row["case"].rsplit(" ", 1)
        ratios = "; ".join(
            f"{label} {_mark(speedups(row)[key], target)}"
            for key, label, target in BASELINES[row["op"]]
        )
        floor = f"{row['fraction_of_floor']:.2f}" if "fraction_of_floor" in row else ""
        host = f"{row['host_us']:.0f}" if "host_us" in row else ""
        lines.append(
            f"| {row['op']} | {shape} | {splits} | {row['times_ms']['ours']:.3f} | "
            f"{tflops(row):.0f} | {host} | {ratios} | {floor} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in BASELINES if any(r["op"] == op for r in result["rows"])]
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops, strict=True):
        rows = [r for r in result["rows"] if r["op"] == op]
        baselines = BASELINES[op]
        width = 0.8 / len(baselines)
        for j, (key, label, target) in enumerate(baselines):
            xs = [i + j * width for i in range(len(rows))]
            values = [speedups(r)[key] for r in rows]
            bars = ax.bar(xs, values, width, label=label)
            for x, v in zip(xs, values, strict=True):
                ax.text(x, v * 1.03, f"{v:.2f}", ha="center", va="bottom", fontsize=6)
            if target is not None:
                color = bars.patches[0].get_facecolor()
                ax.hlines(
                    target, xs[0] - width / 2, xs[-1] + width / 2, colors=color, linestyles="dashed"
                )
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        ax.set_xticklabels([r["case"].replace(" T=", "\nT=") for r in rows], fontsize=7)
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
