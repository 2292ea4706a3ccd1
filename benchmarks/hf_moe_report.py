"""Tables and plots for the Hugging Face MoE benchmark (``bench_hf_moe.py``).

Ratios are the other implementation's time over groupgrad's (above 1 means
groupgrad is faster), each against groupgrad with the same gradient dtype.
"""

from __future__ import annotations

import textwrap
from pathlib import Path


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f}"


def experts_table(result: dict) -> str:
    shape, routing = result["shape"], result["routing"]
    lines = [
        f"GPU: {result['gpu']}, torch {result['torch']} (CUDA {result['cuda']}), transformers "
        f"{result['transformers']}, {result['date']}; Qwen3-MoE experts E={shape['E']}, "
        f"H={shape['H']}, F={shape['F']}, top-{shape['k']}, T={shape['T']} tokens; bf16 weights; "
        f"forward+backward, median of {result['rounds']}×{result['per_round']} interleaved calls "
        f"after {result['warmup']} warm-up. Routing: log-normal popularity, Gumbel top-k (seed 0): "
        f"tokens per expert min {routing['tokens_per_expert_min']}, median "
        f"{routing['tokens_per_expert_median']:.0f}, max {routing['tokens_per_expert_max']}, "
        f"CV {routing['tokens_per_expert_cv']:.2f}.",
        "",
        "| implementation | .grad dtype | ms | TFLOP/s | × groupgrad's time | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, ms in result["times_ms"].items():
        impl, grad = name.split("/")
        ratio = result["ratio_vs_groupgrad"].get(name)
        lines.append(
            f"| {impl} | {'fp32 (grad_dtype)' if grad == 'fp32_grad' else 'bf16'} | {ms:.3f} | "
            f"{result['tflops'][name]:.0f} | {'1.00' if ratio is None else f'{ratio:.2f}'} | "
            f"{_mib(result['peak_bytes'][name])} |"
        )
    errors = result["rel_err_groupgrad_vs_grouped_mm"]
    lines += [
        "",
        "groupgrad vs grouped_mm (fp32 grad_dtype), relative error (norm): "
        + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()),
    ]
    if result.get("fallbacks"):
        lines += ["", "Fallbacks during the run (not the fast path):"]
        lines += [f"- {message}" for message in result["fallbacks"]]
    return "\n".join(lines)


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
    """Time and peak memory per implementation, bf16 ``.grad`` and fp32 ``grad_dtype`` side by side."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    impls = sorted(
        {name.split("/")[0] for name in result["times_ms"]},
        key=["groupgrad", "grouped_mm", "eager"].index,
    )
    grads = ["bf16_grad", "fp32_grad"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.38
    for offset, grad in zip((-width / 2, width / 2), grads, strict=True):
        xs = [i + offset for i in range(len(impls))]
        times = [result["times_ms"][f"{impl}/{grad}"] for impl in impls]
        bars = axes[0].bar(xs, times, width, label=grad.replace("_", " "))
        for bar, impl in zip(bars, impls, strict=True):
            ratio = result["ratio_vs_groupgrad"].get(f"{impl}/{grad}", 1.0)
            axes[0].annotate(
                f"{ratio:.2f}×",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        peaks = [(result["peak_bytes"][f"{impl}/{grad}"] or 0) / 2**30 for impl in impls]
        axes[1].bar(xs, peaks, width, label=grad.replace("_", " "))
    axes[0].set_yscale("log")
    axes[0].set_title("forward+backward ms (label: time / groupgrad's)")
    axes[1].set_title("peak memory of one step (GiB)")
    for ax in axes:
        ax.set_xticks(range(len(impls)))
        ax.set_xticklabels(impls)
        ax.legend(fontsize=8)
    shape = result["shape"]
    fig.suptitle(
        f"Qwen3-MoE experts E={shape['E']} H={shape['H']} F={shape['F']} top-{shape['k']} "
        f"T={shape['T']}, {result['gpu']}, torch {result['torch']}, transformers {result['transformers']}",
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
