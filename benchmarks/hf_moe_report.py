"""Tables and plots for the Hugging Face MoE benchmark (``bench_hf_moe.py``).

Ratios are the other implementation's time over groupgrad's (above 1 means
groupgrad is faster), each against groupgrad with the same gradient dtype;
for ``groupgrad_fp8`` that is FP8's time over bf16's (below 1: FP8 faster).
Rows without FP8 (``fp8_skipped``) say why.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

FP8 = "groupgrad_fp8"


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f}"


def _grad_name(grad: str) -> str:
    return "fp32 (grad_dtype)" if grad == "fp32_grad" else "bf16"


def row_line(row: dict) -> str:
    """One configuration in a line: time and peak of groupgrad against grouped_mm."""
    parts = [
        f"T={row['shape']['T']} sigma={row['sigma']} ckpt={'on' if row['checkpointing'] else 'off'}"
    ]
    for grad in ("bf16_grad", "fp32_grad"):
        ours, theirs = f"groupgrad/{grad}", f"grouped_mm/{grad}"
        parts.append(
            f"{grad}: {row['times_ms'][ours]:.3f} ms ({row['ratio_vs_groupgrad'][theirs]:.2f}x), "
            f"peak {_mib(row['peak_bytes'][ours])} vs {_mib(row['peak_bytes'][theirs])} MiB"
        )
        fp8 = f"{FP8}/{grad}"
        if fp8 in row["times_ms"]:
            parts[-1] += (
                f", FP8 {row['times_ms'][fp8]:.3f} ms (speed-up "
                f"{1 / row['ratio_vs_groupgrad'][fp8]:.2f}x over bf16 groupgrad), peak {_mib(row['peak_bytes'][fp8])} MiB"
            )
    if "fp8_skipped" in row:
        parts.append(row["fp8_skipped"])
    return "; ".join(parts)


def _peak_ratio(row: dict, name: str, grad: str) -> str:
    ours, base = row["peak_bytes"][name], row["peak_bytes"][f"grouped_mm/{grad}"]
    return "n/a" if ours is None or not base else f"{ours / base:.2f}"


def experts_table(result: dict) -> str:
    """Every row (T, skew, checkpointing) × implementation × ``.grad`` dtype: time and peak."""
    first = result["rows"][0]
    shape = first["shape"]
    lines = [
        f"GPU: {result['gpu']}, torch {result['torch']} (CUDA {result['cuda']}), transformers "
        f"{result['transformers']}, {result['date']}; Qwen3-MoE experts E={shape['E']}, "
        f"H={shape['H']}, F={shape['F']}, top-{shape['k']}; bf16 weights; forward+backward, "
        f"median of {result['rounds']}×{result['per_round']} interleaved calls after "
        f"{result['warmup']} warm-up; peak = max allocated during one step minus allocated "
        "before it. Routing: log-normal popularity of spread σ, Gumbel top-k (seed 0).",
        "",
        "| T | σ (tokens/expert min–max, CV) | checkpointing | .grad dtype | implementation | "
        "ms | × groupgrad's time | peak MiB | peak × grouped_mm's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        routing = row["routing"]
        skew = (
            f"{row['sigma']:g} ({routing['tokens_per_expert_min']}–"
            f"{routing['tokens_per_expert_max']}, {routing['tokens_per_expert_cv']:.2f})"
        )
        for name, ms in row["times_ms"].items():
            impl, grad = name.split("/")
            ratio = row["ratio_vs_groupgrad"].get(name)
            lines.append(
                f"| {row['shape']['T']} | {skew} | {'on' if row['checkpointing'] else 'off'} | "
                f"{_grad_name(grad)} | {impl} | {ms:.3f} | "
                f"{'1.00' if ratio is None else f'{ratio:.2f}'} | "
                f"{_mib(row['peak_bytes'][name])} | {_peak_ratio(row, name, grad)} |"
            )
    worst = max(max(row["rel_err_groupgrad_vs_grouped_mm"].values()) for row in result["rows"])
    lines += [
        "",
        f"groupgrad vs grouped_mm (fp32 grad_dtype), largest relative error (norm) of the output "
        f"and every weight gradient over the rows: {worst:.1e}",
    ]
    lines += _fp8_lines(result["rows"])
    if result.get("fallbacks"):
        lines += ["", "Fallbacks during the run (not the fast path):"]
        lines += [f"- {message}" for message in result["fallbacks"]]
    return "\n".join(lines)


def _speedups(rows: list[dict], base: str) -> list[float]:
    """``base``'s time over groupgrad_fp8's, per row and ``.grad`` dtype where both ran."""
    return [
        r["times_ms"][f"{base}/{grad}"] / r["times_ms"][f"{FP8}/{grad}"]
        for r in rows
        for grad in ("bf16_grad", "fp32_grad")
        if f"{FP8}/{grad}" in r["times_ms"] and f"{base}/{grad}" in r["times_ms"]
    ]


def _fp8_lines(rows: list[dict]) -> list[str]:
    """FP8 against bf16 groupgrad over the rows: speed-up range, worst error, skipped rows.

    Beside groupgrad's routed op, FP8 is set against ``groupgrad_unrouted``:
    FP8 runs the same gather, ``grouped_mlp``, combine route (the routed op
    has no FP8 yet), so that ratio isolates the FP8 GEMMs and quantization.
    """
    fp8_rows = [r for r in rows if "rel_err_groupgrad_fp8_vs_grouped_mm" in r]
    lines = []
    if fp8_rows:
        worst = max(max(r["rel_err_groupgrad_fp8_vs_grouped_mm"].values()) for r in fp8_rows)
        lines += ["", f"{FP8} (fp8_recipe='blockwise'), speed-up with the same .grad dtype:"]
        for base in ("groupgrad", "groupgrad_unrouted"):
            ratios = _speedups(fp8_rows, base)
            if ratios:
                lines.append(
                    f"- over bf16 {base} ({base}'s time / FP8's): "
                    f"{min(ratios):.2f}–{max(ratios):.2f}× over {len(ratios)} cells"
                )
        lines.append(
            f"- largest relative error (norm) vs grouped_mm (output and weight gradients, fp32 "
            f"grad_dtype): {worst:.1e}"
        )
    skipped = sorted({r["fp8_skipped"] for r in rows if "fp8_skipped" in r})
    return lines + (["", *skipped] if skipped else [])


def fsdp_table(result: dict) -> str:
    shape = result["shape"]
    lines = [
        f"GPU: {result['gpu']} ×{result['world_size']}, torch {result['torch']}, transformers "
        f"{result['transformers']}, {result['date']}; one Qwen3-MoE decoder layer (E={shape['E']}, "
        f"H={shape['H']}, F={shape['F']}, top-{shape['k']}), {result['tokens_per_rank']} tokens "
        f"per rank (sequences of {result['sequence_length']}); FSDP2 per layer + root, fp32 "
        "master weights, bf16 compute; forward+backward step (synchronized wall clock, median).",
        "",
        "| variant | step ms | × plain FSDP2 fp32 reduce | reduce-scatter MiB/step | dtypes | "
        "bf16-exact fraction of the RS input per unit |",
        "|---|---|---|---|---|---|",
    ]
    for name, ms in result["step_ms"].items():
        fractions = result["reduce_scatter_input_bf16_exact_fraction"][name]
        lines.append(
            f"| {name} | {ms:.2f} | {result['step_ratio_vs_plain_fp32_reduce'][name]:.2f} | "
            f"{result['reduce_scatter_bytes_per_step'][name] / 2**20:.0f} | "
            f"{', '.join(result['reduce_scatter_dtypes'][name])} | "
            f"{', '.join(f'{100 * f:.1f}%' for f in fractions)} |"
        )
    return "\n".join(lines)


def plot_experts(result: dict, path: Path) -> None:
    """Per row: groupgrad's (and groupgrad_fp8's) time and peak over grouped_mm's, per ``.grad`` dtype."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = result["rows"]
    labels = [
        f"T={r['shape']['T']}\nσ={r['sigma']:g}{' ckpt' if r['checkpointing'] else ''}"
        for r in rows
    ]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    series = [(impl, grad) for impl in ("groupgrad", FP8) for grad in ("bf16_grad", "fp32_grad")]
    width = 0.8 / len(series)
    nan = float("nan")  # FP8 not run in that row: no bar
    for i, (impl, grad) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(rows))]
        name, base = f"{impl}/{grad}", f"grouped_mm/{grad}"
        speed = [
            r["times_ms"][base] / r["times_ms"][name] if name in r["times_ms"] else nan
            for r in rows
        ]
        peak = [
            (r["peak_bytes"][name] or 0) / (r["peak_bytes"][base] or 1)
            if name in r["peak_bytes"]
            else nan
            for r in rows
        ]
        label = f"{impl}, {grad.replace('_', ' ')}"
        axes[0].bar(xs, speed, width, label=label)
        axes[1].bar(xs, peak, width, label=label)
    axes[0].set_title("speed-up over grouped_mm (its time / ours)")
    axes[1].set_title("peak memory, ours / grouped_mm (below 1: less)")
    for ax in axes:
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.legend(fontsize=8)
    shape = rows[0]["shape"]
    fig.suptitle(
        f"Qwen3-MoE experts E={shape['E']} H={shape['H']} F={shape['F']} top-{shape['k']}, "
        f"{result['gpu']}, torch {result['torch']}, transformers {result['transformers']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_fsdp(result: dict, path: Path) -> None:
    """Step time and reduce-scatter bytes per FSDP2 variant."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = list(result["step_ms"])
    labels = [textwrap.fill(name.replace("_", " ").replace("/", " / "), 22) for name in names]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    axes[0].bar(range(len(names)), [result["step_ms"][n] for n in names], color="tab:blue")
    axes[0].set_title("forward+backward step ms (incl. reduce-scatter)")
    axes[1].bar(
        range(len(names)),
        [result["reduce_scatter_bytes_per_step"][n] / 2**20 for n in names],
        color="tab:orange",
    )
    axes[1].set_title("reduce-scatter MiB per step and rank")
    for ax in axes:
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(labels, fontsize=7)
    fig.suptitle(
        f"FSDP2 on {result['world_size']}× {result['gpu']}, torch {result['torch']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
