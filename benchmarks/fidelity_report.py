"""Table, verdict and loss-curve plot of the FP8 fidelity run (``fidelity_fp8.py``'s JSON).

Target (issue 27): FP8's final loss within max(1.5 % of bf16's mean, 2× bf16's
seed spread) of bf16's mean; ``main_grad`` after 4 micro-batches within 2× one
FP8 GEMM's error of the fp64 sum, with a bf16-exact share < 1 %. Works on a
partial JSON (a run cut short) too.

Usage: ``python benchmarks/fidelity_report.py benchmarks/results/fidelity_fp8_h200.json
[--png PATH]`` prints the markdown and writes the PNG (default: beside the JSON).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RELATIVE_BOUND, SPREAD_FACTOR = 0.015, 2.0
COLORS = {"bf16": "tab:blue", "fp8": "tab:orange"}
SEED_COLORS = ("tab:green", "tab:purple", "tab:brown", "tab:gray")


def summarize(result: dict) -> dict:
    """Per recipe: final losses by seed, mean, spread; the gap FP8 − bf16 and its verdict."""
    recipes: dict[str, dict] = {}
    for run in result.get("runs", []):
        entry = recipes.setdefault(run["recipe"], {"seeds": [], "final": [], "eval": []})
        entry["seeds"].append(run["seed"])
        entry["final"].append(run["final_loss"])
        entry["eval"].append(run.get("eval_loss"))
        entry.setdefault("eval_init", []).append(run.get("eval_loss_init"))
    for entry in recipes.values():
        entry["mean"] = sum(entry["final"]) / len(entry["final"])
        entry["spread"] = max(entry["final"]) - min(entry["final"])
    summary: dict = {"recipes": recipes}
    if "bf16" in recipes and "fp8" in recipes:
        bf16, fp8 = recipes["bf16"], recipes["fp8"]
        common = sorted(set(bf16["seeds"]) & set(fp8["seeds"]))
        bound = max(RELATIVE_BOUND * bf16["mean"], SPREAD_FACTOR * bf16["spread"])
        gap = fp8["mean"] - bf16["mean"]
        summary.update(
            gap=gap,
            gap_relative=gap / bf16["mean"],
            bound=bound,
            within=abs(gap) <= bound,
            per_seed_gap={
                s: fp8["final"][fp8["seeds"].index(s)] - bf16["final"][bf16["seeds"].index(s)]
                for s in common
            },
            seeds_compared=len(common),
        )
    return summary


def checks_lines(result: dict) -> str:
    """The wgrad-error and ``main_grad`` checks as markdown tables."""
    lines = []
    werr = result.get("wgrad_error")
    if werr:
        lines += [
            f"wgrad relative error (Frobenius) against fp64 of the unquantized bf16 operands, "
            f"{werr['routed_rows']} routed rows of the trained model's middle block:",
            "",
            "| layer | GEMM bf16 | GEMM FP8 | FP8 vs fp64 of its dequantized operands | "
            "GroupedMLP call bf16 | GroupedMLP call FP8 |",
            "|---|---|---|---|---|---|",
        ]
        for name in ("fc1", "fc2"):
            g, m = werr["gemm"][name], werr["layer"][name]
            lines.append(
                f"| {name} | {g['bf16']:.2e} | {g['fp8']:.2e} | {g['fp8_vs_dequantized']:.2e} | "
                f"{m['bf16']:.2e} | {m['fp8']:.2e} |"
            )
    mg = result.get("main_grad")
    if mg:
        lines += [
            "",
            f"FP8 `main_grad` after {mg['micro_batches']} accumulated micro-batches against "
            "the fp64 sum of the dequantized operands' products:",
            "",
            "| layer | rel. error | one FP8 GEMM's error | tolerance (≥ 2⁻²⁴) | ratio (≤ 2) | "
            "first micro-batch alone (the layer's GEMM = the replica's?) | bf16-exact share (< 1 %) | bf16 path's share |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in ("fc1", "fc2"):
            r = mg[name]
            verdict = "ok" if r["within_2x_tolerance"] else "miss"
            share = "ok" if r["bf16_exact_share"] < 0.01 else "miss"
            lines.append(
                f"| {name} | {r['rel_error_vs_fp64_sum']:.2e} | {r['single_gemm_error']:.2e} | "
                f"{r['per_gemm_tolerance']:.2e} | "
                f"{r['ratio_to_tolerance']:.2f} ({verdict}) | "
                f"{r['first_microbatch_rel_error']:.2e}"
                f"{' (= replica)' if r.get('first_microbatch_equals_replica_gemm') else ' (≠ replica)'}"
                f" | {100 * r['bf16_exact_share']:.2f} % "
                f"({share}) | {100 * r['bf16_path_bf16_exact_share']:.2f} % |"
            )
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """Header, the loss table with the verdict, and the checks."""
    cfg = result["config"]
    summary = result.get("summary") or summarize(result)
    lines = [
        f"{result['gpu']}, torch {result['torch']}, {result['date']}"
        + ("" if result.get("complete") else " — **partial: the run did not finish**"),
        f"Model: {cfg['layers']} blocks (causal attention + MoE), H = {cfg['hidden']}, "
        f"{cfg['experts']} experts (SwiGLU, F = {cfg['ffn']}, top-{cfg['top_k']}), "
        f"V = {cfg['vocab']}; {cfg['tokens']} tokens per step ({cfg['seq']}-token sequences), "
        f"{cfg['steps']} steps, AdamW lr {cfg['lr']}; loss starts at ln V = "
        f"{result['loss_start']:.3f}, the source's entropy is {result['loss_floor']:.3f}. "
        f"Final loss: mean of the last {min(cfg['final_window'], cfg['steps'])} steps.",
        "",
        "| recipe | final loss per seed | mean | spread (max − min) | held-out loss per seed "
        "(untrained → trained) | "
        "s per run |",
        "|---|---|---|---|---|---|",
    ]
    for recipe, entry in summary["recipes"].items():
        runs = [r for r in result["runs"] if r["recipe"] == recipe]
        finals = ", ".join(f"{v:.4f}" for v in entry["final"])
        evals = ", ".join(
            "–" if v is None else (f"{v:.4f}" if i is None else f"{i:.3f} → {v:.4f}")
            for v, i in zip(entry["eval"], entry.get("eval_init", entry["eval"]), strict=True)
        )
        secs = ", ".join(f"{r['seconds']:.1f}" for r in runs)
        lines.append(
            f"| {recipe} | {finals} | {entry['mean']:.4f} | {entry['spread']:.4f} | {evals} | "
            f"{secs} |"
        )
    if "gap" in summary:
        verdict = "within" if summary["within"] else "**outside**"
        lines += [
            "",
            f"Gap FP8 − bf16: {summary['gap']:+.4f} ({100 * summary['gap_relative']:+.2f} %), "
            f"{verdict} the bound max(1.5 % × {summary['recipes']['bf16']['mean']:.4f}, "
            f"2 × {summary['recipes']['bf16']['spread']:.4f}) = {summary['bound']:.4f} "
            f"({summary['seeds_compared']} seeds each).",
        ]
    checks = checks_lines(result)
    if checks:
        lines += ["", checks]
    if result.get("fallbacks"):
        lines += ["", "Fallbacks: " + "; ".join(result["fallbacks"])]
    return "\n".join(lines)


def _smooth(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def plot(result: dict, path: Path) -> None:
    """Loss curves (every run) and the per-seed FP8 − bf16 loss difference."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (curves, diff) = plt.subplots(1, 2, figsize=(12, 4.5))
    runs = result["runs"]
    for run in runs:
        steps = range(1, len(run["losses"]) + 1)
        label = f"{run['recipe']} seed {run['seed']}"
        style = "--" if run["recipe"] == "fp8" else "-"
        curves.plot(steps, run["losses"], style, color=COLORS.get(run["recipe"]), lw=0.8,
                    alpha=0.8, label=label)  # fmt: skip
    curves.axhline(result["loss_floor"], color="gray", ls=":", lw=1, label="source entropy")
    curves.set_xlabel("step")
    curves.set_ylabel("training cross-entropy (nats)")
    curves.set_title("loss curves, bf16 (solid) vs FP8 experts (dashed)")
    curves.legend(fontsize=7)
    by_key = {(r["recipe"], r["seed"]): r["losses"] for r in runs}
    for (recipe, seed), losses in by_key.items():
        if recipe != "fp8" or ("bf16", seed) not in by_key:
            continue
        delta = [a - b for a, b in zip(losses, by_key[("bf16", seed)], strict=True)]
        diff.plot(range(1, len(delta) + 1), _smooth(delta, 10), lw=1, label=f"seed {seed}",
                  color=SEED_COLORS[seed % len(SEED_COLORS)])  # fmt: skip
    summary = result.get("summary") or summarize(result)
    if "bound" in summary:
        for sign in (1, -1):
            diff.axhline(sign * summary["bound"], color="tab:red", ls="--", lw=0.8)
    diff.axhline(0, color="black", lw=0.6)
    diff.set_xlabel("step")
    diff.set_title("FP8 − bf16 loss per seed (10-step mean); red: the bound")
    if diff.get_legend_handles_labels()[0]:
        diff.legend(fontsize=7)
    fig.suptitle(f"FP8 fidelity, {result['gpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--png", type=Path, default=None, help="default: beside the JSON")
    args = parser.parse_args(argv)
    result = json.loads(args.json.read_text())
    result["summary"] = summarize(result)
    print(markdown(result))
    png = args.png or args.json.with_suffix(".png")
    plot(result, png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
