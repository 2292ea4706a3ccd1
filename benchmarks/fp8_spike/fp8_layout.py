"""The FP8 wgrad operand layout in plain PyTorch: quantizer, dequantizer, references.

Legend: E experts, T tokens, C channels (N for dy, K for x), splits_E tokens per
expert, Tp = round_up(T + 15 E, 16) padded token columns, NB = ceil(T / 128) + E
scale rows, B = 128 tokens per scale block.

Layout (fixed by the quantizer of the real pipeline; the CUDA spike reads exactly this):

* data ``q_CTp``: e4m3, row-major (C, Tp); expert e's tokens are columns
  ``[col_e, col_e + T_e)``, ``col_e = sum_{j<e} round_up(T_j, 16)``; padding columns are 0.
* scales ``s_NBC``: fp32, row-major (NB, C); expert e's blocks are rows
  ``[row_e, row_e + ceil(T_e / 128))``, ``row_e = sum_{j<e} ceil(T_j / 128)``; row
  ``row_e + b`` scales tokens ``[128 b, min(T_e, 128 b + 128))`` of the expert, one
  value per channel: the smallest power of two >= amax / 448 (1.0 for an all-zero block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128
E4M3_MAX = 448.0
COLUMN_ALIGN = 16


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def ceil_div(value: int, divisor: int) -> int:
    return (value + divisor - 1) // divisor


@dataclass(frozen=True)
class SegmentLayout:
    """Where each expert's tokens, padded columns and scale rows start."""

    splits: tuple[int, ...]
    token_start: tuple[int, ...]
    column_start: tuple[int, ...]
    block_start: tuple[int, ...]
    padded_tokens: int  # Tp
    scale_rows: int  # NB

    @classmethod
    def from_splits(cls, splits: list[int] | tuple[int, ...]) -> SegmentLayout:
        if any(t < 0 for t in splits):
            raise ValueError(f"splits must be >= 0, got {list(splits)}")
        token, column, block = [0], [0], [0]
        for t in splits:
            token.append(token[-1] + t)
            column.append(column[-1] + round_up(t, COLUMN_ALIGN))
            block.append(block[-1] + ceil_div(t, BLOCK))
        total, experts = token[-1], len(splits)
        return cls(
            splits=tuple(splits),
            token_start=tuple(token[:-1]),
            column_start=tuple(column[:-1]),
            block_start=tuple(block[:-1]),
            padded_tokens=round_up(total + (COLUMN_ALIGN - 1) * experts, COLUMN_ALIGN),
            scale_rows=ceil_div(total, BLOCK) + experts,
        )

    @property
    def tokens(self) -> int:
        return sum(self.splits)


@dataclass
class Quantized:
    """One quantized operand: ``data`` (C, Tp) e4m3 and ``scales`` (NB, C) fp32."""

    data: torch.Tensor
    scales: torch.Tensor
    layout: SegmentLayout


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= amax / 448 (exact, via frexp); 1.0 where amax is 0."""
    ratio = amax.float() / E4M3_MAX
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    scale = torch.ldexp(torch.ones_like(ratio), exponent)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize(v_TC: torch.Tensor, layout: SegmentLayout) -> Quantized:
    """Quantizes token-major values ``v_TC`` (T, C) into the layout above."""
    T, C = v_TC.shape
    if layout.tokens != T:
        raise ValueError(f"splits sum to {layout.tokens} but v_TC has {T} rows")
    device = v_TC.device
    q_CTp = torch.zeros(C, layout.padded_tokens, dtype=torch.float8_e4m3fn, device=device)
    s_NBC = torch.ones(layout.scale_rows, C, dtype=torch.float32, device=device)
    for e, t_e in enumerate(layout.splits):
        if t_e == 0:
            continue
        blocks = ceil_div(t_e, BLOCK)
        start = layout.token_start[e]
        seg_TC = v_TC[start : start + t_e].float()
        padded = torch.zeros(blocks * BLOCK, C, dtype=torch.float32, device=device)
        padded[:t_e] = seg_TC
        scale_bC = pow2_scale(padded.view(blocks, BLOCK, C).abs().amax(dim=1))
        per_token_TC = scale_bC.repeat_interleave(BLOCK, dim=0)[:t_e]
        q_TC = (seg_TC / per_token_TC).to(torch.float8_e4m3fn)
        column = layout.column_start[e]
        q_CTp[:, column : column + t_e] = q_TC.t()
        row = layout.block_start[e]
        s_NBC[row : row + blocks] = scale_bC
    return Quantized(q_CTp, s_NBC, layout)


def expert_data(q: Quantized, e: int) -> torch.Tensor:
    """Expert e's e4m3 data as a (C, T_e) view of ``q.data``."""
    column = q.layout.column_start[e]
    return q.data[:, column : column + q.layout.splits[e]]


def expert_scales(q: Quantized, e: int) -> torch.Tensor:
    """Expert e's scale rows as a (ceil(T_e / 128), C) view of ``q.scales``."""
    row = q.layout.block_start[e]
    return q.scales[row : row + ceil_div(q.layout.splits[e], BLOCK)]


def dequantize_expert(q: Quantized, e: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Expert e's dequantized values, token-major (T_e, C)."""
    t_e = q.layout.splits[e]
    token_block = torch.arange(t_e, device=q.data.device) // BLOCK
    return expert_data(q, e).t().to(dtype) * expert_scales(q, e).to(dtype)[token_block]


def reference_wgrad(dyq: Quantized, xq: Quantized, e: int) -> torch.Tensor:
    """fp64 dW_e (N, K) = dequant(dy_e)^T dequant(x_e): the exact product of what the kernel reads."""
    return dequantize_expert(dyq, e).t() @ dequantize_expert(xq, e)


def blockwise_wgrad(dyq: Quantized, xq: Quantized, e: int) -> torch.Tensor:
    """fp64 dW_e computed the kernel's way: per 128-token block, the unscaled e4m3
    product scaled by the outer product of the block's two scale vectors, summed."""
    a_NT = expert_data(dyq, e).to(torch.float64)
    b_KT = expert_data(xq, e).to(torch.float64)
    sa_bN = expert_scales(dyq, e).to(torch.float64)
    sb_bK = expert_scales(xq, e).to(torch.float64)
    out = torch.zeros(a_NT.shape[0], b_KT.shape[0], dtype=torch.float64, device=a_NT.device)
    for b in range(sa_bN.shape[0]):
        block = slice(b * BLOCK, (b + 1) * BLOCK)
        out += (a_NT[:, block] @ b_KT[:, block].t()) * sa_bN[b][:, None] * sb_bK[b][None, :]
    return out


def random_operand(
    T: int, C: int, generator: torch.Generator, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Random (T, C) bf16 values whose magnitude varies by channel and by token, so
    that scale blocks differ (2^-3 .. 2^3 per channel and per token)."""
    v = torch.randn(T, C, generator=generator, device=device)
    channel = torch.exp2(torch.randint(-3, 4, (1, C), generator=generator, device=device).float())
    token = torch.exp2(torch.randint(-3, 4, (T, 1), generator=generator, device=device).float())
    return (v * channel * token).to(torch.bfloat16)


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max-norm error / max-norm ref, Frobenius error / Frobenius ref), in fp64."""
    diff = out.to(torch.float64) - ref.to(torch.float64)
    ref64 = ref.to(torch.float64)
    inf = diff.abs().max().item() / max(ref64.abs().max().item(), 1e-300)
    fro = diff.norm().item() / max(ref64.norm().item(), 1e-300)
    return inf, fro


def selftest() -> bool:
    """Checks the quantizer's layout and the references on CPU (no GPU, no CUTLASS)."""
    results: dict[str, bool] = {}
    generator = torch.Generator().manual_seed(0)
    splits = (150, 0, 4113, 77)
    N, K = 48, 40
    layout = SegmentLayout.from_splits(splits)
    results["layout offsets"] = (
        layout.column_start == (0, 160, 160, 4288)
        and layout.block_start == (0, 2, 2, 35)
        and layout.padded_tokens == 4400  # round_up(4340 + 45, 16)
        and layout.scale_rows == 38  # ceil(4340 / 128) + 4
    )
    dy_TN = random_operand(layout.tokens, N, generator)
    x_TK = random_operand(layout.tokens, K, generator)
    dyq, xq = quantize(dy_TN, layout), quantize(x_TK, layout)

    used = torch.zeros(layout.padded_tokens, dtype=torch.bool)
    for e, t in enumerate(splits):
        used[layout.column_start[e] : layout.column_start[e] + t] = True
    results["padding columns are zero"] = bool((dyq.data[:, ~used].float() == 0).all())
    last_row = layout.block_start[-1] + ceil_div(splits[-1], BLOCK)
    results["unused scale rows are 1.0"] = bool((dyq.scales[last_row:] == 1).all())

    scale_ok = dequant_ok = True
    for q, v_TC in ((dyq, dy_TN), (xq, x_TK)):
        for e, t in enumerate(splits):
            seg = v_TC[layout.token_start[e] : layout.token_start[e] + t].double()
            for b in range(ceil_div(t, BLOCK)):  # naive per-block amax, independent of quantize()
                amax = seg[b * BLOCK : (b + 1) * BLOCK].abs().amax(dim=0)
                scale = q.scales[layout.block_start[e] + b].double()
                exact_pow2 = bool((torch.frexp(scale)[0] == 0.5).all())
                bound = bool((scale >= amax / 448).all() and (scale / 2 < amax / 448).all())
                scale_ok &= exact_pow2 and bound
            if t:
                deq = dequantize_expert(q, e)
                token_scale = q.scales[layout.block_start[e] + torch.arange(t) // BLOCK].double()
                tolerance = seg.abs() * 2.0**-4 + token_scale * 2.0**-10
                dequant_ok &= bool(((deq - seg).abs() <= tolerance).all())
    results["scales: pow2, >= amax/448, minimal"] = scale_ok
    results["dequantized within e4m3 rounding"] = dequant_ok

    edge = pow2_scale(torch.tensor([448.0, 449.0, 0.0, 224.0, 448.0 * 2.0**-20, 300.0]))
    results["pow2_scale edge cases"] = edge.tolist() == [1.0, 2.0, 1.0, 0.5, 2.0**-20, 1.0]

    blockwise_ok = True
    quant_error = 0.0
    for e, t in enumerate(splits):
        if t == 0:
            continue
        ref = reference_wgrad(dyq, xq, e)
        blockwise_ok &= relative_errors(blockwise_wgrad(dyq, xq, e), ref)[1] < 1e-12
        s = layout.token_start[e]
        exact = dy_TN[s : s + t].double().t() @ x_TK[s : s + t].double()
        quant_error = max(quant_error, relative_errors(ref, exact)[1])
    results["fp64 reference == blockwise (kernel-order) sum"] = blockwise_ok
    results["quantization error vs bf16 inputs < 10%"] = quant_error < 0.1
    print(f"[selftest] fp8 quantization rel_fro error vs unquantized: {quant_error:.3e}")

    for name, ok in results.items():
        print(f"[selftest] {'PASS' if ok else 'FAIL'}  {name}")
    return all(results.values())
