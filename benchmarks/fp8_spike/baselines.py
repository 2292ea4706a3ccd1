"""Baselines of the FP8 wgrad spike: cuBLASLt's blockwise ``scaled_mm`` and a bf16 mm,
each found among the call forms the installed torch accepts (the API moved between
releases), by trying them on a small problem against an fp64 reference.

Legend: N out_features, K in_features, T_e tokens of one expert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from fp8_layout import BLOCK, Quantized, ceil_div, expert_data, expert_scales, relative_errors

ScaledMm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def scaled_mm_variants() -> list[tuple[str, ScaledMm]]:
    """Ways to call cuBLASLt's 1x128 x 1x128 recipe, newest API first.

    Each takes a_NT (N, T_e) row-major e4m3, b_TK (T_e, K) column-major e4m3,
    sa_Nb (N, blocks) with strides (1, N) and sb_bK (blocks, K) row-major.
    """
    F = torch.nn.functional
    variants: list[tuple[str, ScaledMm]] = []
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        bw = F.ScalingType.BlockWise1x128

        def v2_kb(a, b, sa, sb):
            return F.scaled_mm(a, b, sa, bw, sb.t(), bw, output_dtype=torch.float32)

        def v2_bk(a, b, sa, sb):
            return F.scaled_mm(a, b, sa, bw, sb, bw, output_dtype=torch.float32)

        variants += [
            ("F.scaled_mm(scale_b=(K, blocks))", v2_kb),
            ("F.scaled_mm(scale_b=(blocks, K))", v2_bk),
        ]

    def v1_bk(a, b, sa, sb):
        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)

    def v1_kb(a, b, sa, sb):
        return torch._scaled_mm(a, b, sa, sb.t(), out_dtype=torch.float32)

    variants += [
        ("torch._scaled_mm(scale_b=(blocks, K))", v1_bk),
        ("torch._scaled_mm(scale_b=(K, blocks))", v1_kb),
    ]
    return variants


def padded_expert_operands(
    dyq: Quantized, xq: Quantized, e: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e's operands for scaled_mm, tokens zero-padded to a multiple of 128
    (contiguous copies: cuBLASLt gets dense operands, not views into the padded layout)."""
    a_NT = _pad_tokens(expert_data(dyq, e))
    b_KT = _pad_tokens(expert_data(xq, e))
    sa_Nb = expert_scales(dyq, e).t()  # (N, blocks), strides (1, N)
    sb_bK = expert_scales(xq, e).contiguous()
    return a_NT, b_KT.t(), sa_Nb, sb_bK


def _pad_tokens(data_CT: torch.Tensor) -> torch.Tensor:
    t_e = data_CT.shape[1]
    padded = torch.zeros(
        data_CT.shape[0], ceil_div(t_e, BLOCK) * BLOCK, dtype=data_CT.dtype, device=data_CT.device
    )
    padded[:, :t_e] = data_CT
    return padded


def pick_scaled_mm(
    dyq: Quantized, xq: Quantized, e: int, ref: torch.Tensor, log: list[dict]
) -> ScaledMm | None:
    """The first scaled_mm variant that runs and matches the fp64 reference on expert e."""
    operands = padded_expert_operands(dyq, xq, e)
    for name, fn in scaled_mm_variants():
        try:
            out = fn(*operands)
            torch.cuda.synchronize()
            inf, fro = relative_errors(out, ref)
            log.append({"variant": name, "dtype": str(out.dtype), "rel_inf": inf, "rel_fro": fro})
            print(f"  scaled_mm {name}: rel_inf {inf:.3e} rel_fro {fro:.3e}")
            if fro < 1e-2:
                return fn
        except Exception as exc:  # API differs between torch versions: try the next one
            log.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"[:600]})
            print(f"  scaled_mm {name}: {type(exc).__name__}: {str(exc)[:300]}")
    return None


Bf16Wgrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]


def pick_bf16_wgrad(log: list[dict], device: str) -> tuple[str, Bf16Wgrad] | None:
    """A bf16 (T_e, N)^T (T_e, K) product accumulated into fp32, fused if torch can."""
    candidates: list[tuple[str, Bf16Wgrad]] = [
        ("addmm(out_dtype=fp32, out=main_grad)", _bf16_addmm_fused),
        ("main_grad += mm(out_dtype=fp32)", _bf16_mm_then_add),
        ("main_grad += mm().float()", _bf16_mm_float_add),
    ]
    generator = torch.Generator(device=device).manual_seed(7)
    a = torch.randn(256, 64, generator=generator, device=device).bfloat16()
    b = torch.randn(256, 96, generator=generator, device=device).bfloat16()
    init = torch.randn(64, 96, generator=generator, device=device)
    want = init.double() + a.t().double() @ b.double()
    for name, fn in candidates:
        try:
            out = init.clone()
            fn(out, a.t(), b)
            torch.cuda.synchronize()
            _, fro = relative_errors(out, want)
            log.append({"variant": name, "rel_fro": fro})
            if fro < 1e-2:  # a sanity bound: the product may be rounded to bf16 first
                return name, fn
        except Exception as exc:
            log.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
    return None


def _bf16_addmm_fused(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Any:
    return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)


def _bf16_mm_then_add(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Any:
    return out.add_(torch.mm(a, b, out_dtype=torch.float32))


def _bf16_mm_float_add(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Any:
    return out.add_(torch.mm(a, b).float())
