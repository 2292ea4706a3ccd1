"""GroupedLinear over every combination DESIGN.md names, against a per-expert fp64 reference.

{per-expert, single grouped weight} × {plain, distributed} × {no main_grad,
accumulate, overwrite} × {delay, no delay} × {zero_out_wgrad} × {bias} ×
{``fp8_recipe=None``, ``"blockwise"``}, each over several micro-batches in a
row. The distributed leader's forward materialization scales the weights by 2
and its backward one by 4, so the test sees which weights each GEMM used.

With ``fp8_recipe="blockwise"`` the reference multiplies, in fp64, the
dequantized FP8 forms each GEMM must read (the FP8 GEMMs' semantics): ``x``'s
``(1, 128)`` form and the forward's weights for ``y``; ``dy``'s ``(1, 128)``
form and the backward's weights for ``dx``; both ``(128, 1)`` forms for the
wgrad; the unquantized ``dy`` for the bias. A GEMM fed another form (or a
form derived from another FP8 form) misses the reference's 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from groupgrad.kernels import quantize_fp8
from groupgrad.modules import GroupedLinear
from groupgrad.protocol.testing import FakeDistributedWeight
from groupgrad_testsupport import matrix
from groupgrad_testsupport.matrix import Case

E = 4  # and one expert: a layer of one (e.g. one expert per expert-parallel rank)
MICRO_BATCHES = 3
SIZES = {None: (16, 8), "blockwise": (256, 128)}  # recipe -> (K, N): FP8 blocks are 128 wide
SPLITS = {
    None: [[5, 0, 7, 3], [0, 4, 4, 9], [6, 2, 0, 0]],
    "blockwise": [[140, 0, 7, 3], [0, 4, 4, 9], [6, 2, 0, 0]],  # an expert of two token blocks
}
ROWS, WEIGHTS, TOKENS = (1, 128), (128, 128), (128, 1)


CASES = Case.all()


def _build(
    case: Case, seed: int, recipe: str | None, experts: int
) -> tuple[GroupedLinear, list[torch.Tensor]]:
    torch.manual_seed(seed)
    K, N = SIZES[recipe]
    flags = matrix.module_flags(case)
    module = GroupedLinear(experts, K, N, **flags, dtype=torch.float32, fp8_recipe=recipe)
    if case.kind == "distributed":
        matrix.distribute_fake(module, case.main_grad)
    weights = [getattr(module, n) for n in module.weight_names]
    generator = torch.Generator().manual_seed(seed + 1)
    matrix.attach_main_grads(weights, case.main_grad, zero_out=case.zero_out, generator=generator)
    return module, weights


def _gemm_operands(
    module: GroupedLinear, case: Case, x: torch.Tensor, dy: torch.Tensor, splits: list[int]
) -> dict[str, torch.Tensor]:
    """The fp64 operand each GEMM must read: the tensors, or the dequantized FP8 forms."""
    fwd_scale, bwd_scale = (2.0, 4.0) if case.kind == "distributed" else (1.0, 1.0)
    w = torch.stack(matrix.experts_fp64(module)[0])
    if module.fp8_recipe is None:
        x64, dy64 = x.double(), dy.double()
        return {"x": x64, "w_fwd": fwd_scale * w, "dy": dy64, "w_bwd": bwd_scale * w,
                "dy_wgrad": dy64, "x_wgrad": x64}  # fmt: skip
    x_rows, x_tokens = quantize_fp8(x, block=(ROWS, TOKENS), splits=splits)
    dy_rows, dy_tokens = quantize_fp8(dy, block=(ROWS, TOKENS), splits=splits)
    w32 = w.float()  # the materialized weights, quantized for each GEMM (exact scalings)
    w_fwd = quantize_fp8(fwd_scale * w32, block=WEIGHTS).dequantize()
    w_bwd = quantize_fp8(bwd_scale * w32, block=WEIGHTS).dequantize()
    forms = {"x": x_rows, "w_fwd": w_fwd, "dy": dy_rows, "w_bwd": w_bwd,
             "dy_wgrad": dy_tokens, "x_wgrad": x_tokens}  # fmt: skip
    return {
        name: torch.as_tensor(f if isinstance(f, torch.Tensor) else f.dequantize()).double()
        for name, f in forms.items()
    }


def _reference(
    module: GroupedLinear, case: Case, x: torch.Tensor, dy: torch.Tensor, splits: list[int]
) -> dict[str, torch.Tensor]:
    """fp64 per-expert reference: y, dx, per-parameter dw, per-parameter db."""
    ops = _gemm_operands(module, case, x, dy, splits)
    b_list = matrix.experts_fp64(module)[1]
    ys, dxs, dws, dbs = [], [], [], []
    for e, (x_e, dy_e, dy_w, x_w, b_e) in enumerate(
        zip(
            *(ops[n].split(splits) for n in ("x", "dy", "dy_wgrad", "x_wgrad")), b_list, strict=True
        )
    ):
        ys.append(F.linear(x_e, ops["w_fwd"][e], b_e))
        dxs.append(dy_e @ ops["w_bwd"][e])
        dws.append(dy_w.T @ x_w)
        dbs.append(dy.double().split(splits)[e].sum(0))
    dw = [torch.stack(dws)] if case.layout == "single" else dws
    db = [torch.stack(dbs)] if case.layout == "single" else dbs
    return {"y": torch.cat(ys), "dx": torch.cat(dxs), "dw": dw, "db": db}  # type: ignore[dict-item]


@pytest.mark.parametrize("experts", [E, 1])
@pytest.mark.parametrize("recipe", [None, "blockwise"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_grouped_linear_matrix(case: Case, recipe: str | None, experts: int) -> None:
    # experts=1 catches: a one-expert layer's single (N, K) wgrad buffer given to the GEMM as
    # a packed (E, N, K) out (every backward failed)
    module, weights = _build(case, seed=7, recipe=recipe, experts=experts)
    K, N = SIZES[recipe]
    biases = [getattr(module, n) for n in module.bias_names]
    initial_main_grad = [w.main_grad.clone() if case.main_grad != "none" else None for w in weights]
    sum_dw = [torch.zeros(w.shape, dtype=torch.float64) for w in weights]
    sum_db = [torch.zeros(b.shape, dtype=torch.float64) for b in biases]
    gen = torch.Generator().manual_seed(123)

    for step, splits in enumerate(matrix.splits_for(experts, SPLITS[recipe])[:MICRO_BATCHES]):
        tokens = sum(splits)
        x = torch.randn(tokens, K, generator=gen).requires_grad_()
        dy = torch.randn(tokens, N, generator=gen)
        ref = _reference(module, case, x.detach(), dy, splits)

        y = module(x, splits)
        matrix.assert_matrix_close(y, ref["y"], f"y at step {step}")
        before = [w.main_grad.clone() if case.main_grad != "none" else None for w in weights]
        y.backward(dy)
        matrix.assert_matrix_close(x.grad, ref["dx"], f"dx at step {step}")

        matrix.assert_main_grads_wait_for_backward_dw(case, weights, before)
        module.backward_dw()

        for index, dw in enumerate(ref["dw"]):
            sum_dw[index] += dw
        for index in range(len(biases)):
            sum_db[index] += ref["db"][index]

        labels = [f"{name} at step {step}" for name in module.weight_names]
        matrix.assert_weight_grads(
            case, weights, labels, latest=ref["dw"], total=sum_dw, initial=initial_main_grad
        )
        for index, b in enumerate(biases):
            matrix.assert_matrix_close(b.grad, sum_db[index], f"bias grad {index} at step {step}")
        if case.kind == "distributed":
            # what the layer handed the implementer, against the fp64 oracle (not the fake)
            received = weights[0].finalized[-1]
            for index, dw in enumerate(ref["dw"]):
                matrix.assert_matrix_close(
                    received[index], dw, f"wgrad handed to finalize, member {index}"
                )
        elif case.main_grad != "none":
            matrix.write_into_dummies(weights, versioned=not case.zero_out)
        x.grad = None

    if case.kind == "distributed":
        leader = weights[0]
        assert isinstance(leader, FakeDistributedWeight)
        assert leader.calls["materialize_group_for_forward"] == MICRO_BATCHES
        assert leader.calls["materialize_group_for_backward"] == MICRO_BATCHES
        assert leader.calls["finalize_group_grads"] == MICRO_BATCHES
    if case.delay:
        with pytest.raises(
            RuntimeError,
            match=r"GroupedLinear\.backward_dw\(\) was called but no backward has queued",
        ):
            module.backward_dw()
