"""Lines, tables and the plot of the Megatron-Core MoE layer benchmark (``bench_megatron_moe.py``).

Speed-ups are ``SequentialMLP``'s time over the backend's (above 1: faster);
the FP8 table's are bf16 ``groupgrad_fused``'s time over the FP8 backend's.
A shape whose FP8 backend was skipped (``fp8_skipped`` in its row) has no
FP8 entries and shows its reason in the FP8 table.
"""

from __future__ import annotations

from pathlib import Path

FUSED = "groupgrad_fused"
FP8_BACKENDS = ("groupgrad_fused_fp8", "groupgrad_fused_fp8_cached")


def _shape(row: dict) -> str:
    return f"{row['E']}, {row['H']}, {row['F']}, {row['k']}, {row['S']}"


def one_line(row: dict) -> str:
    s = row["speedup_layer"]
    e = row["speedup_experts"]
    line = (
        f"{row['name']}: layer step sequential {row['layer_ms']['sequential']:.3f} ms, "
        f"groupgrad_fused {row['layer_ms'][FUSED]:.3f} ms ({s[FUSED]:.2f}x), "
        f"groupgrad {row['layer_ms']['groupgrad']:.3f} ms ({s['groupgrad']:.2f}x); experts alone "
        f"{e[FUSED]:.2f}x / {e['groupgrad']:.2f}x"
    )
    fp8 = row.get("fp8_vs_bf16_fused")
    if fp8 is None:
        return f"{line}; {row['fp8_skipped']}"
    err = row["rel_diff_vs_sequential"][FP8_BACKENDS[0]]["output"]
    return (
        f"{line}; FP8 over bf16 fused: layer {fp8[FP8_BACKENDS[0]]['layer']:.2f}x "
        f"(cached weights {fp8[FP8_BACKENDS[1]]['layer']:.2f}x), experts "
        f"{fp8[FP8_BACKENDS[0]]['experts']:.2f}x ({fp8[FP8_BACKENDS[1]]['experts']:.2f}x), "
        f"output rel. diff vs sequential {err:.1e}"
    )


def markdown_table(result: dict) -> str:
    """The bf16 table (as in the megatron_core README), then the FP8 table."""
    lines = [
        f"MoE layer step, {result['gpu']}, megatron-core {result['megatron_core']}, torch {result['torch']}",
        "",
        "| shape (E, H, F, top-k, tokens) | sequential ms | groupgrad_fused ms (×) | groupgrad ms (×) "
        "| experts alone: fused × / unfused × | experts TFLOP/s fused / seq |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        t, s, e, tf = (
            row["layer_ms"],
            row["speedup_layer"],
            row["speedup_experts"],
            row["experts_tflops"],
        )
        lines.append(
            f"| {_shape(row)} | {t['sequential']:.3f} | "
            f"{t[FUSED]:.3f} ({s[FUSED]:.2f}×) | {t['groupgrad']:.3f} "
            f"({s['groupgrad']:.2f}×) | {e[FUSED]:.2f}× / {e['groupgrad']:.2f}× | "
            f"{tf[FUSED]:.0f} / {tf['sequential']:.0f} |"
        )
    return "\n".join([*lines, "", fp8_table(result)])


def fp8_table(result: dict) -> str:
    """FP8 fused experts against bf16 fused experts: layer step, experts alone, share outside them."""
    lines = [
        "FP8 (fp8='e4m3', fp8_recipe='blockwise') fused experts against bf16 fused experts; "
        "× = bf16 time / FP8 time. 'requantized': every step quantizes the weights (one "
        "micro-batch per optimizer step); 'cached': the weights quantized at the step's first "
        "micro-batch are reused (the later micro-batches). Outside-experts share = (layer step − "
        "experts forward+backward) / layer step: router, permutation, dispatch, combine, "
        "gradient-buffer zeroing and DDP's sync (the non-GEMM part of the layer outside the "
        "experts' own SwiGLU and quantization kernels).",
        "",
        "| shape (E, H, F, top-k, tokens) | bf16 fused layer ms | FP8 layer ms, requantized (×) "
        "| FP8 layer ms, cached (×) | experts alone ms: bf16 / FP8 requantized (×) / cached (×) "
        "| outside-experts share: bf16 / FP8 | FP8 output, input grad rel. diff vs sequential |",
        "|---|---|---|---|---|---|---|",
    ]
    fresh, cached = FP8_BACKENDS
    for row in result["rows"]:
        ratio = row.get("fp8_vs_bf16_fused")
        if ratio is None:
            lines.append(f"| {_shape(row)} | {row['layer_ms'][FUSED]:.3f} | {row['fp8_skipped']} |")
            continue
        t, x, share = row["layer_ms"], row["experts_ms"], row["outside_experts_share"]
        diff = row["rel_diff_vs_sequential"][fresh]
        lines.append(
            f"| {_shape(row)} | {t[FUSED]:.3f} | {t[fresh]:.3f} ({ratio[fresh]['layer']:.2f}×) | "
            f"{t[cached]:.3f} ({ratio[cached]['layer']:.2f}×) | {x[FUSED]:.3f} / "
            f"{x[fresh]:.3f} ({ratio[fresh]['experts']:.2f}×) / {x[cached]:.3f} "
            f"({ratio[cached]['experts']:.2f}×) | {100 * share[FUSED]:.0f} % / "
            f"{100 * share[fresh]:.0f} % | {diff['output']:.1e}, {diff['input_grad']:.1e} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Speed-ups over ``SequentialMLP``: whole layer step and experts alone, per shape and backend."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = result["rows"]
    labels = [r["name"] for r in rows]
    backends = [
        (FUSED, "groupgrad fused"),
        ("groupgrad", "groupgrad grouped linears"),
        (FP8_BACKENDS[0], "groupgrad fused FP8 (requantized)"),
        (FP8_BACKENDS[1], "groupgrad fused FP8 (cached weights)"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(5 + 3 * len(rows), 4.4))
    width = 0.8 / len(backends)
    for ax, key, title in zip(
        axes, ("speedup_layer", "speedup_experts"), ("MoE layer step", "experts alone"), strict=True
    ):
        for i, (backend, label) in enumerate(backends):
            offset = (i - (len(backends) - 1) / 2) * width
            ax.bar(
                [x + offset for x in range(len(rows))],
                [r[key].get(backend, float("nan")) for r in rows],  # NaN: FP8 skipped, no bar
                width,
                label=label,
            )
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{title}: speed-up vs SequentialMLP")
        ax.set_xticks(list(range(len(rows))))
        ax.set_xticklabels(labels, fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Megatron-Core MoE layer, {result['gpu']}, megatron-core {result['megatron_core']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
