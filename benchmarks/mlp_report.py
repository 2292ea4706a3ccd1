"""Table and plot for the grouped-MLP benchmark (``bench_mlp.py``).

``speedup_vs_grouped_mm`` is a speed-up (the ``torch._grouped_mm`` MLP's time
over ours, above 1 means ours is faster); ``overhead_vs_gemm_sum`` is how much
longer our whole step takes than our six GEMMs alone.
"""

from __future__ import annotations

from pathlib import Path


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f}"


def _host(row: dict, key: str) -> str:
    value = row.get("host_us_per_step", {}).get(key)
    return "n/a" if value is None else f"{value:.0f}"


def _verdict(row: dict, targets: dict) -> str:
    misses = []
    if row["speedup_vs_grouped_mm"] < targets["speedup_vs_grouped_mm"]:
        misses.append("speed-up")
    if row["overhead_vs_gemm_sum"] > targets["overhead_vs_gemm_sum"]:
        misses.append("overhead")
    return "ok" if not misses else "miss: " + ", ".join(misses)


def one_line(row: dict, targets: dict) -> str:
    t = row["times_ms"]
    return (
        f"{row['case']:44s} ours {t['ours']:.3f} ms ({row['tflops']['ours']:.0f} TFLOP/s) | "
        f"_grouped_mm MLP {t['grouped_mm_mlp']:.3f} ms: x{row['speedup_vs_grouped_mm']:.2f} | "
        f"GEMM sum {t['gemm_sum']:.3f} ms: overhead {100 * row['overhead_vs_gemm_sum']:+.1f}% | "
        f"SwiGLU fwd {row['swiglu_ms']['forward']:.3f} + bwd {row['swiglu_ms']['backward']:.3f} ms"
        f" | kernels back to back {row['swiglu_ms'].get('kernel_sequence', float('nan')):.3f} ms"
        f" | per-expert params {t.get('ours_per_expert', float('nan')):.3f} ms"
        f" | host us/step {_host(row, 'ours')} ours, {_host(row, 'ours_per_expert')} per-expert"
        f" | peak MiB {_mib(row['peak_bytes']['ours'])} vs "
        f"{_mib(row['peak_bytes']['grouped_mm_mlp'])} | {_verdict(row, targets)}"
    )


def markdown_table(result: dict) -> str:
    targets = result["targets"]
    lines = [
        f"GPU: {result['gpu']}, torch {result['torch']} (CUDA {result['cuda']}), triton "
        f"{result['triton']}, {result['date']}; median of {result['reps']} calls after "
        f"{result['warmup']} warm-up, {result['n_sets']} rotated input sets; bf16 inputs, fp32 "
        f"main_grad. Targets: speed-up >= {targets['speedup_vs_grouped_mm']}, overhead <= "
        f"{100 * targets['overhead_vs_gemm_sum']:.0f}%.",
        "",
        "| E, H, F, T | splits | ours ms | TFLOP/s | _grouped_mm MLP ms | speed-up | "
        "GEMM sum ms | overhead | SwiGLU fwd+bwd ms | peak MiB ours / _grouped_mm | max rel err | "
        "verdict | per-expert params ms | host µs/step ours / per-expert |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        t = row["times_ms"]
        swiglu = row["swiglu_ms"]["forward"] + row["swiglu_ms"]["backward"]
        lines.append(
            f"| {row['E']}, {row['H']}, {row['F']}, {row['T']} | {row['split_kind']} | "
            f"{t['ours']:.3f} | {row['tflops']['ours']:.0f} | {t['grouped_mm_mlp']:.3f} | "
            f"{row['speedup_vs_grouped_mm']:.2f} | {t['gemm_sum']:.3f} | "
            f"{100 * row['overhead_vs_gemm_sum']:+.1f}% | {swiglu:.3f} | "
            f"{_mib(row['peak_bytes']['ours'])} / {_mib(row['peak_bytes']['grouped_mm_mlp'])} | "
            f"{max(row['rel_err_vs_grouped_mm'].values()):.1e} | {_verdict(row, targets)} | "
            f"{t.get('ours_per_expert', float('nan')):.3f} | "
            f"{_host(row, 'ours')} / {_host(row, 'ours_per_expert')} |"
        )
    if result["fallbacks"]:
        lines += ["", "Fallbacks during the run (not the fast path):"]
        lines += [f"- {message}" for message in result["fallbacks"]]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Speed-up vs the ``torch._grouped_mm`` MLP, overhead vs our GEMM sum, and peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = result["rows"]
    labels = [f"E={r['E']} H={r['H']}\nF={r['F']} T={r['T']}\n{r['split_kind']}" for r in rows]
    xs = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(6 + 2.2 * len(rows), 4.8))
    targets = result["targets"]

    speedups = [r["speedup_vs_grouped_mm"] for r in rows]
    axes[0].bar(xs, speedups, color="tab:blue")
    axes[0].axhline(targets["speedup_vs_grouped_mm"], color="tab:red", ls="--", label="target")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_title("speed-up vs _grouped_mm MLP\n(their time / ours)")
    axes[0].legend()

    overheads = [100 * r["overhead_vs_gemm_sum"] for r in rows]
    axes[1].bar(xs, overheads, color="tab:orange")
    axes[1].axhline(100 * targets["overhead_vs_gemm_sum"], color="tab:red", ls="--")
    axes[1].set_title("overhead vs our GEMM sum (%)")

    ours = [(r["peak_bytes"]["ours"] or 0) / 2**30 for r in rows]
    theirs = [(r["peak_bytes"]["grouped_mm_mlp"] or 0) / 2**30 for r in rows]
    width = 0.4
    axes[2].bar([x - width / 2 for x in xs], ours, width, label="ours")
    axes[2].bar([x + width / 2 for x in xs], theirs, width, label="_grouped_mm MLP")
    axes[2].set_title("peak memory of one step (GiB)")
    axes[2].legend()

    for ax in axes:
        ax.title.set_fontsize(9)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
    fig.suptitle(f"GroupedMLP forward+backward, {result['gpu']}, torch {result['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
