"""The FP8 fidelity run's wgrad checks, on operands captured from the trained model.

Legend: ``R`` routed rows (tokens × top-k), ``E`` experts, ``H`` hidden, ``F``
expert ffn size; ``x_RH`` the experts' input, ``dy_RH`` the gradient of their
output, ``probs_R`` the router probabilities, ``splits_E`` rows per expert.
A capture is ``(x_RH, splits_E, probs_R, dy_RH)`` from one training forward
and backward (bf16 ``x`` and ``dy``, fp32 ``probs``, device ``splits``).

* :func:`wgrad_errors` — the FP8 wgrad's error against an fp64 wgrad of the
  unquantized bf16 operands, beside the bf16 path's: per grouped GEMM (fc1:
  ``dh``, ``x``; fc2: ``dy``, ``a``, the operands the bf16 ``GroupedMLP``
  computes) and per ``GroupedMLP`` call (fp32 master weights under bf16
  autocast, as the model trains, against the fp64 MLP of the bf16 operands).
* :func:`main_grad_check` — an FP8 ``GroupedMLP`` (bf16 weights, fp32
  ``main_grad``, Megatron's layout) accumulates four micro-batches; its
  ``main_grad`` against the fp64 sum of the four micro-batches' products of
  the dequantized ``(128, 1)`` operands. Those operands are rebuilt here with
  the public kernels, step by step as the FP8 MLP computes them
  (:func:`fp8_wgrad_operands`; the layer's ``main_grad`` after the first
  micro-batch must equal one GEMM of them). The per-GEMM tolerance is one FP8
  wgrad GEMM's error against the fp64 product of the same operands, measured
  here, but at least one fp32 rounding (2⁻²⁴): ``main_grad`` is fp32, and each
  micro-batch's add rounds it once more. The floor only matters where the GEMM
  is nearly exact (the CPU reference, about 1e-8); the CUTLASS FP8 GEMM errs
  by about 3e-4.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from groupgrad import kernels
from groupgrad.kernels import (
    Fp8Blocks,
    grouped_dgrad,
    grouped_fprop,
    grouped_wgrad,
    quantize_fp8,
    swiglu_probs_backward,
)
from groupgrad.modules import GroupedMLP

ROWS, WEIGHTS, TOKENS = (1, 128), (128, 128), (128, 1)
FP32_ROUNDING = 2.0**-24  # one rounding of an fp32 value, relative: the floor of any fp32 sum
Capture = tuple[Tensor, Tensor, Tensor, Tensor]


def rel_error(ours: Tensor, ref64: Tensor) -> float:
    """``‖ours − ref‖ / ‖ref‖`` in fp64 (Frobenius over every expert)."""
    return float((ours.double() - ref64).norm() / ref64.norm())


def bf16_exact_share(t: Tensor) -> float:
    """Share of ``t``'s nonzero fp32 values that a bf16 holds exactly."""
    nonzero = t[t != 0]
    if nonzero.numel() == 0:
        return float("nan")
    return float((nonzero.to(torch.bfloat16).float() == nonzero).float().mean())


def _dense(t: Tensor | Fp8Blocks) -> Tensor:
    return torch.as_tensor(t.dequantize() if isinstance(t, Fp8Blocks) else t).double()


def wgrad64(d_RN: Tensor | Fp8Blocks, x_RK: Tensor | Fp8Blocks, splits: Sequence[int]) -> Tensor:
    """``d_e.T @ x_e`` per expert in fp64, ``(E, N, K)``; FP8 forms are dequantized first."""
    pairs = zip(_dense(d_RN).split(list(splits)), _dense(x_RK).split(list(splits)), strict=True)
    return torch.stack([d_e.T @ x_e for d_e, x_e in pairs])


def mlp_wgrads64(
    w1_E2FH: Tensor, w2_EHF: Tensor, capture: Capture, splits: Sequence[int]
) -> tuple[Tensor, Tensor]:
    """fc1's and fc2's wgrads of the fused MLP, in fp64 from the given (bf16) values."""
    x_RH, _, probs_R, dy_RH = capture
    w1 = w1_E2FH.detach().double().requires_grad_()
    w2 = w2_EHF.detach().double().requires_grad_()
    rows = zip(x_RH.double().split(list(splits)), probs_R.double().split(list(splits)), strict=True)
    ys = []
    for e, (x_e, p_e) in enumerate(rows):
        gate, up = (x_e @ w1[e].T).chunk(2, dim=1)
        ys.append((F.silu(gate) * up * p_e[:, None]) @ w2[e].T)
    dw1, dw2 = torch.autograd.grad(torch.cat(ys), [w1, w2], dy_RH.double())
    return dw1, dw2


def bf16_wgrad_operands(w1: Tensor, w2: Tensor, capture: Capture) -> dict[str, tuple[Tensor, ...]]:
    """The bf16 MLP's wgrad operands: fc1 ``(dh, x)``, fc2 ``(dy, a)`` (bf16 weights)."""
    x_RH, splits_E, probs_R, dy_RH = capture
    h = grouped_fprop(x_RH, w1, splits_E)
    da = grouped_dgrad(dy_RH, w2, splits_E)
    dh, _, a = swiglu_probs_backward(da, h, probs_R)
    return {"fc1": (dh, x_RH), "fc2": (dy_RH, a)}


def fp8_wgrad_operands(
    w1: Tensor, w2: Tensor, capture: Capture
) -> dict[str, tuple[Fp8Blocks, ...]]:
    """The FP8 MLP's ``(128, 1)`` wgrad operands, rebuilt as ``GroupedMLP`` computes them.

    ``x`` and ``dy`` quantized into both forms from one read; ``h`` from the
    FP8 fprop, kept in ``(1, 128)``; ``da`` from the FP8 dgrad; ``dh`` and the
    recomputed ``a`` from the SwiGLU backward reading ``h`` dequantized (bf16
    weights). Where the kernels have the fused FP8 SwiGLU
    (``swiglu_probs_backward_fp8``, which the bias-free MLP then runs), the
    SwiGLU and its quantizations run through it, else unfused.
    """
    x_RH, splits_E, probs_R, dy_RH = capture
    x_rows, x_tokens = quantize_fp8(x_RH, block=(ROWS, TOKENS), splits=splits_E)
    h = grouped_fprop(x_rows, quantize_fp8(w1, block=WEIGHTS), splits_E)
    dy_rows, dy_tokens = quantize_fp8(dy_RH, block=(ROWS, TOKENS), splits=splits_E)
    da = grouped_dgrad(dy_rows, quantize_fp8(w2, block=WEIGHTS), splits_E)
    fused = getattr(kernels, "swiglu_probs_backward_fp8", None)
    if fused is not None:
        h_kept, _ = kernels.swiglu_probs_fp8(h, probs_R)
        _, dh_tokens, _, a_tokens = fused(da, h_kept, probs_R, splits=splits_E, dh_rows=False)
        return {"fc1": (dh_tokens, x_tokens), "fc2": (dy_tokens, a_tokens)}
    h = torch.as_tensor(quantize_fp8(h, block=ROWS).dequantize()).to(h.dtype)
    dh, _, a = swiglu_probs_backward(da, h, probs_R)
    _, dh_tokens = quantize_fp8(dh, block=(ROWS, TOKENS), splits=splits_E)
    a_tokens = quantize_fp8(a, block=TOKENS, splits=splits_E)
    return {"fc1": (dh_tokens, x_tokens), "fc2": (dy_tokens, a_tokens)}


def _mlp(master: GroupedMLP, recipe: str | None, dtype: torch.dtype, **flags: bool) -> GroupedMLP:
    """A packed ``GroupedMLP`` holding ``master``'s weights in ``dtype``."""
    mlp = GroupedMLP(
        master.num_groups,
        master.hidden_size,
        master.ffn_hidden_size,
        dtype=dtype,
        device=master.fc1.weight.device,
        single_grouped_weight=True,
        fp8_recipe=recipe,
        **flags,
    )
    with torch.no_grad():
        mlp.fc1.weight.copy_(master.fc1.weight)
        mlp.fc2.weight.copy_(master.fc2.weight)
    return mlp


def wgrad_errors(master: GroupedMLP, capture: Capture) -> dict:
    """fc1/fc2 wgrad errors of bf16 and FP8 against fp64 of the unquantized bf16 operands."""
    splits = capture[1].tolist()
    w1, w2 = (getattr(master, n).weight.detach().to(torch.bfloat16) for n in ("fc1", "fc2"))
    gemm: dict[str, dict[str, float]] = {}
    for name, (d, x) in bf16_wgrad_operands(w1, w2, capture).items():
        ref = wgrad64(d, x, splits)
        d8, x8 = (quantize_fp8(t, block=TOKENS, splits=capture[1]) for t in (d, x))
        fp8 = grouped_wgrad(d8, x8, capture[1], out_dtype=torch.float32)
        gemm[name] = {
            "bf16": rel_error(grouped_wgrad(d, x, capture[1], out_dtype=torch.float32), ref),
            "fp8": rel_error(fp8, ref),
            "fp8_vs_dequantized": rel_error(fp8, wgrad64(d8, x8, splits)),
        }
    refs = mlp_wgrads64(w1, w2, capture, splits)
    layer: dict[str, dict[str, float]] = {"fc1": {}, "fc2": {}}
    x_RH, splits_E, probs_R, dy_RH = capture
    for key, recipe in (("bf16", None), ("fp8", "blockwise")):
        mlp = _mlp(master, recipe, torch.float32)  # fp32 masters under autocast, as trained
        with torch.autocast(x_RH.device.type, dtype=torch.bfloat16):
            y = mlp(x_RH, splits_E, probs_R)
        y.backward(dy_RH)
        for name, ref in zip(("fc1", "fc2"), refs, strict=True):
            layer[name][key] = rel_error(getattr(mlp, name).weight.grad, ref)
    return {"gemm": gemm, "layer": layer, "routed_rows": int(x_RH.shape[0])}


def main_grad_check(master: GroupedMLP, captures: Sequence[Capture]) -> dict:
    """Accumulate ``len(captures)`` micro-batches into fp32 ``main_grad`` (FP8 and bf16 layers)."""
    w1, w2 = (getattr(master, n).weight.detach().to(torch.bfloat16) for n in ("fc1", "fc2"))
    layers = {}
    for key, recipe in (("fp8", "blockwise"), ("bf16", None)):
        mlp = _mlp(master, recipe, torch.bfloat16, accumulate_into_main_grad=True)
        for p in (mlp.fc1.weight, mlp.fc2.weight):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            p.grad_added_to_main_grad = False
        layers[key] = mlp
    expected = {"fc1": 0.0, "fc2": 0.0}
    single: dict[str, float] = {}
    first: dict[str, float] = {}
    replica_exact: dict[str, bool] = {}
    for i, capture in enumerate(captures):
        x_RH, splits_E, probs_R, dy_RH = capture
        for key, mlp in layers.items():
            flag = (i == 0) if key == "fp8" else None
            mlp(x_RH, splits_E, probs_R, is_first_microbatch=flag).backward(dy_RH)
        splits = splits_E.tolist()
        for name, (d8, x8) in fp8_wgrad_operands(w1, w2, capture).items():
            product = wgrad64(d8, x8, splits)
            expected[name] = expected[name] + product
            if i == 0:  # the per-GEMM tolerance, and the layer's first micro-batch alone
                one = grouped_wgrad(d8, x8, splits_E, out_dtype=torch.float32)
                layer_grad = getattr(layers["fp8"], name).weight.main_grad
                single[name] = rel_error(one, product)
                first[name] = rel_error(layer_grad, product)
                replica_exact[name] = bool(torch.equal(layer_grad, one))
    out: dict = {"micro_batches": len(captures)}
    for name in ("fc1", "fc2"):
        main_grad = getattr(layers["fp8"], name).weight.main_grad
        error = rel_error(main_grad, expected[name])  # type: ignore[arg-type]
        tolerance = max(single[name], FP32_ROUNDING)
        out[name] = {
            "rel_error_vs_fp64_sum": error,
            "single_gemm_error": single[name],
            "per_gemm_tolerance": tolerance,
            "ratio_to_tolerance": error / tolerance,
            "within_2x_tolerance": error <= 2 * tolerance,
            "first_microbatch_rel_error": first[name],
            "first_microbatch_equals_replica_gemm": replica_exact[name],
            "bf16_exact_share": bf16_exact_share(main_grad),
            "bf16_path_bf16_exact_share": bf16_exact_share(
                getattr(layers["bf16"], name).weight.main_grad
            ),
        }
    return out
