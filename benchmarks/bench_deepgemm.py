"""Our FP8 wgrad beside DeepGEMM's k-grouped FP8 wgrad, timed interleaved in one process.

DeepGEMM (github.com/deepseek-ai/DeepGEMM) ships the FP8 weight gradient that
MoE pretraining on Hopper uses: ``k_grouped_fp8_gemm_nt_contiguous`` on sm_90,
the same recipe as ours (both operands in 128-token blocks with one fp32
scale per block and column), fp32 out, accumulating into ``c``. Its contract
differs: every expert's token count a multiple of 128 (callers pad), the
counts as a host list, one stacked ``(E, N, K)`` output. Each cell here times,
on the same random bf16 data (two input sets rotated between calls):

* ``fp8``: ours, ``grouped_wgrad`` of the ``(128, 1)`` forms into a packed
  fp32 ``(E, N, K)`` ``main_grad`` (accumulate), device splits, no padding;
* ``bf16``: ours in bf16 into the same fp32 ``main_grad``;
* ``deepgemm``: DeepGEMM's call on its own quantization of the same data
  (``deep_gemm.utils.per_channel_cast_to_fp8``, each expert zero-padded to
  128 tokens, done before timing), accumulating into its own fp32 output.

TFLOP/s count the real tokens' FLOPs for every column (DeepGEMM's padding is
its cost). Each result's error against the fp32 product of the unquantized
bf16 operands is printed beside it. Cells: DeepGEMM's wgrad shapes, those of
``bench_fp8_gemm.py`` (``deepgemm_cells``: the same token counts). DeepGEMM must be importable; its
kernels compile on first use (``--warm`` compiles one cell's and exits, so
several processes can compile in parallel first). Writes
``results/deepgemm_<gpu>.json``. Usage: ``python benchmarks/bench_deepgemm.py
[--reps 16] [--cells 0 1 ...] [--warm]``. Build DeepGEMM's extension with the
compiler whose libstdc++ the process loads (``CXX=g++`` where ``CXX`` names
another GCC: ``torch.utils.cpp_extension`` compiles with ``$CXX``, and a
mismatched build crashes in DeepGEMM's first call; DEVICE_RUNS 175–179).
Measured on an H200 (DEVICE_RUNS 180): ours 0.85–0.93× DeepGEMM.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Callable
from pathlib import Path

import kernels_timing as kt
import torch
from bench_fp8_gemm import N_SETS, SEGMENTS, deepgemm_cells

from groupgrad.kernels import grouped_wgrad, quantize_fp8


def _deepgemm_operand(t: torch.Tensor, splits: list[int], cast: Callable) -> tuple:
    """DeepGEMM's K-major k-grouped operand of ``t`` (T, C): each expert's tokens zero-padded to
    128, quantized by DeepGEMM's own per-channel cast, stored (C, tokens) per expert, back to back;
    its scales (C, blocks). Returns ``((data, scales), padded token counts)``."""
    data, scales, padded, start = [], [], [], 0
    for count in splits:
        rows = -(-count // 128) * 128
        block = torch.zeros(rows, t.shape[1], dtype=t.dtype, device=t.device)
        block[:count] = t[start : start + count]
        q, s = cast(block, use_ue8m0=False)
        data.append(q.t().contiguous().flatten())
        scales.append(s)
        padded.append(rows)
        start += count
    return (torch.cat(data), torch.cat(scales).t()), padded


def deepgemm_wgrad(
    dy: torch.Tensor, x: torch.Tensor, splits: list[int], out: torch.Tensor
) -> tuple[Callable[[], None], list[int]]:
    """DeepGEMM's k-grouped FP8 wgrad of ``dy``, ``x`` (on its own quantization) accumulating
    into ``out`` ``(E, N, K)``, as a call; and the padded token counts it runs on."""
    import deep_gemm
    from deep_gemm.utils import per_channel_cast_to_fp8

    a, padded = _deepgemm_operand(dy, splits, per_channel_cast_to_fp8)
    b, _ = _deepgemm_operand(x, splits, per_channel_cast_to_fp8)
    layout = torch.tensor(padded, device=dy.device, dtype=torch.int32)

    def call() -> None:
        deep_gemm.k_grouped_fp8_gemm_nt_contiguous(a, b, out, padded, layout, c=out)

    return call, padded


def bench_cell(E: int, N: int, K: int, label: str, splits: list[int], reps: int,
               warm_only: bool) -> dict | None:  # fmt: skip
    T = sum(splits)
    dev = torch.tensor(splits, device="cuda")
    gens = [torch.Generator(device="cuda").manual_seed(300 + E + i) for i in range(2 * N_SETS)]
    dy = [torch.randn(T, N, generator=gens[i], device="cuda").bfloat16() for i in range(N_SETS)]
    x = [torch.randn(T, K, generator=gens[N_SETS + i], device="cuda").bfloat16()
         for i in range(N_SETS)]  # fmt: skip
    dg_out = torch.zeros(E, N, K, device="cuda")
    dg_calls = [deepgemm_wgrad(dy[i], x[i], splits, dg_out) for i in range(N_SETS)]
    padded = dg_calls[0][1]

    def deepgemm(i: int) -> None:
        dg_calls[i][0]()

    deepgemm(0)  # compiles DeepGEMM's kernel for this shape on first use
    torch.cuda.synchronize()
    if warm_only:
        return None
    dy8 = [quantize_fp8(t, block=SEGMENTS, splits=dev) for t in dy]
    x8 = [quantize_fp8(t, block=SEGMENTS, splits=dev) for t in x]
    main_grad = torch.zeros(E, N, K, device="cuda")
    # Errors of one accumulation into zeros, against the fp32 product of the bf16 operands.
    starts = [sum(splits[:e]) for e in range(E + 1)]
    truth = torch.stack([dy[0][starts[e] : starts[e + 1]].float().t()
                         @ x[0][starts[e] : starts[e + 1]].float() for e in range(E)])  # fmt: skip
    dg_out.zero_()
    deepgemm(0)
    grouped_wgrad(dy8[0], x8[0], dev, out=main_grad, accumulate=True)
    errors = {"fp8": kt.rel_error(main_grad, truth), "deepgemm": kt.rel_error(dg_out, truth)}
    del truth
    fns: dict[str, Callable[[int], object]] = {
        "fp8": lambda i: grouped_wgrad(dy8[i], x8[i], dev, out=main_grad, accumulate=True),
        "bf16": lambda i: grouped_wgrad(dy[i], x[i], dev, out=main_grad, accumulate=True),
        "deepgemm": deepgemm,
    }
    ms = kt.interleaved_ms(fns, N_SETS, rounds=4, per_round=max(1, reps // 4))
    flops = 2.0 * T * N * K
    tflops = {k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()}
    return {"op": "wgrad_fp32", "E": E, "K": K, "N": N, "T": T, "splits": label,
            "padded_T": sum(padded), **{f"{k}_ms": v for k, v in ms.items()},
            **{f"{k}_tflops": v for k, v in tflops.items()},
            **{f"{k}_rel_error": v for k, v in errors.items()},
            "fp8_over_deepgemm": ms["deepgemm"] / ms["fp8"]}  # fmt: skip


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows``: TFLOP/s and ours / DeepGEMM speed per cell."""
    lines = [
        "| E | N | K | T | tokens per expert | ours FP8 TFLOP/s | DeepGEMM TFLOP/s "
        "| ours / DeepGEMM | ours bf16 TFLOP/s | error ours / DeepGEMM |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['E']} | {r['N']} | {r['K']} | {r['T']} | {r['splits']} "
            f"| {r['fp8_tflops']:.0f} | {r['deepgemm_tflops']:.0f} "
            f"| {r['fp8_over_deepgemm']:.2f} | {r['bf16_tflops']:.0f} "
            f"| {r['fp8_rel_error']:.2e} / {r['deepgemm_rel_error']:.2e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--reps", type=int, default=16)
    parser.add_argument("--cells", type=int, nargs="+", help="indices into the cells (default all)")
    parser.add_argument("--warm", action="store_true", help="compile DeepGEMM's kernels only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_deepgemm.py needs a CUDA GPU")
    try:
        import deep_gemm
    except ImportError as error:
        raise SystemExit(f"bench_deepgemm.py needs DeepGEMM importable: {error}") from None
    chosen = deepgemm_cells()
    picked = args.cells if args.cells is not None else range(len(chosen))
    rows = []
    for index in picked:
        row = bench_cell(*chosen[index], reps=args.reps, warm_only=args.warm)
        if row is not None:
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if args.warm:
        return
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "deep_gemm": getattr(deep_gemm, "__version__", "?"),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "reps": args.reps, "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "deepgemm_" + result["gpu"].lower().replace("nvidia ", "").replace(" ", "_")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
