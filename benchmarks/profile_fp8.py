"""One FP8 GEMM call for Nsight Compute: ours, cuBLASLt's blockwise ``scaled_mm`` or DeepGEMM's.

Builds the inputs, warms the implementation up, then runs it once between
``cudaProfilerStart`` and ``cudaProfilerStop``; profile only that window::

    ncu --profile-from-start off --csv --log-file OUT.csv --section SpeedOfLight \\
        --section LaunchStats python benchmarks/profile_fp8.py --op wgrad --impl ours

Cells: fprop ``E = 8, K = 7168, N = 4096, T = 32768`` (uniform; cuBLASLt: the
dense ``(T, N, K)`` product with expert 0's weight), wgrad DeepGEMM's ``E = 8,
N = 4096, K = 7168``, 4,096 tokens per expert (cuBLASLt: expert 0's product,
fp32 out; DeepGEMM: its k-grouped wgrad, as ``bench_deepgemm.py`` calls it).
Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_deepgemm import deepgemm_wgrad

from groupgrad.kernels import grouped_fprop, grouped_wgrad, quantize_fp8

BW = F.ScalingType.BlockWise1x128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("fprop", "wgrad"), required=True)
    parser.add_argument("--impl", choices=("ours", "cublaslt", "deepgemm"), required=True)
    args = parser.parse_args()
    if args.impl == "deepgemm" and args.op != "wgrad":
        parser.error("--impl deepgemm profiles the wgrad only (DeepGEMM's k-grouped GEMM)")
    E, K, N, per = 8, 7168, 4096, 4096
    T = E * per
    splits = torch.full((E,), per, device="cuda")
    if args.op == "fprop":
        x8 = quantize_fp8(torch.randn(T, K, device="cuda").bfloat16(), block=(1, 128))
        w8 = quantize_fp8(torch.randn(E, N, K, device="cuda").bfloat16(), block=(128, 128))
        out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
        s = w8.scales[0]
        run = {
            "ours": lambda: grouped_fprop(x8, w8, splits, out=out),
            "cublaslt": lambda: F.scaled_mm(
                x8.data, w8.data[0].t(), x8.scales, BW, s.t(), F.ScalingType.BlockWise128x128,
                output_dtype=torch.bfloat16,
            ),
        }[args.impl]  # fmt: skip
    else:
        dy, x = (
            torch.randn(T, N, device="cuda").bfloat16(),
            torch.randn(T, K, device="cuda").bfloat16(),
        )
        dy8 = quantize_fp8(dy, block=(128, 1), splits=splits)
        x8 = quantize_fp8(x, block=(128, 1), splits=splits)
        main_grad = torch.zeros(E, N, K, device="cuda")
        a = quantize_fp8(dy[:per].t().contiguous(), block=(1, 128))
        b = quantize_fp8(x[:per].t().contiguous(), block=(1, 128))
        runs = {
            "ours": lambda: grouped_wgrad(dy8, x8, splits, out=main_grad, accumulate=True),
            "cublaslt": lambda: F.scaled_mm(
                a.data, b.data.t(), a.scales, BW, b.scales, BW, output_dtype=torch.float32
            ),
        }
        if args.impl == "deepgemm":  # its operands built here, outside the profiled window
            runs["deepgemm"], _ = deepgemm_wgrad(dy, x, [per] * E, main_grad)
        run = runs[args.impl]
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
