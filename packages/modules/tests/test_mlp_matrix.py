"""GroupedMLP over every combination DESIGN.md names, against a per-expert fp64 reference.

{per-expert, single grouped weight} × {plain, distributed (fc1 and fc2 both
led by fake leaders)} × {no main_grad, accumulate, overwrite} × {delay, no
delay} × {zero_out_wgrad} × {bias}, each over three micro-batches in a row
(probs given, then ``None``, then given; zero-token experts at the start, in
the middle and at the end). ``main_grad`` starts as NaN for overwrite (the
founding bug: a fused MLP that left ``main_grad`` untouched fails at once) and
as random values for accumulate. The fake leaders' forward materialization
scales the weights by 2 and the backward one by 4, so the test sees which
weights each GEMM used.

Each case runs with ``fp8_recipe=None`` and ``"blockwise"``. For FP8 the
fp64 reference multiplies the dequantized FP8 form each GEMM must read, each
quantized (in the test, from the fp64 chain rounded to the module's dtype)
from the unquantized tensor: ``x``'s and ``a``'s ``(1, 128)`` forms and the
forward's weights for the fprops, ``dy``'s and ``dh``'s ``(1, 128)`` forms and
the backward's weights for the dgrads, the ``(128, 1)`` forms of ``dy``/``a``
and ``dh``/``x`` for the wgrads; the SwiGLU (PyTorch's, fp64) reads ``h``'s
dequantized ``(1, 128)`` form in forward and backward; bias gradients sum the
unquantized ``dy`` and ``dh``. A GEMM fed another form, a form derived from
another FP8 form, or an ``a`` other than the forward's misses the 1e-5.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.nn import functional as F

from groupgrad.kernels import quantize_fp8
from groupgrad.modules import GroupedMLP
from groupgrad.protocol.testing import FakeDistributedWeight
from groupgrad_testsupport import matrix
from groupgrad_testsupport.matrix import Case

E = 4
SIZES = {None: (16, 8), "blockwise": (128, 128)}  # recipe -> (H, F): FP8 blocks are 128 wide
SPLITS = {
    None: [[0, 5, 0, 7], [4, 0, 6, 3], [6, 2, 5, 0]],
    "blockwise": [[0, 5, 0, 137], [4, 0, 6, 3], [6, 2, 5, 0]],  # an expert of two token blocks
}
WITH_PROBS = [True, False, True]
ROWS, WEIGHTS, TOKENS = (1, 128), (128, 128), (128, 1)


# zero_out_wgrad concerns the main_grad dummy only
CASES = [c for c in Case.all() if not (c.zero_out and c.main_grad == "none")]


def _layer_weights(module: GroupedMLP, layer: str) -> list[torch.Tensor]:
    linear = getattr(module, layer)
    return [getattr(linear, n) for n in linear.weight_names]


def _build(case: Case, seed: int, recipe: str | None) -> tuple[GroupedMLP, list[torch.Tensor]]:
    torch.manual_seed(seed)
    H, FFN = SIZES[recipe]
    flags = matrix.module_flags(case)
    module = GroupedMLP(E, H, FFN, **flags, dtype=torch.float32, fp8_recipe=recipe)
    if case.kind == "distributed":
        matrix.distribute_fake(module.fc1, case.main_grad)
        matrix.distribute_fake(module.fc2, case.main_grad)
    weights = _layer_weights(module, "fc1") + _layer_weights(module, "fc2")
    generator = torch.Generator().manual_seed(seed + 1)
    matrix.attach_main_grads(weights, case.main_grad, zero_out=case.zero_out, generator=generator)
    return module, weights


def _reader(recipe: str | None, splits: list[int]) -> Callable[[Tensor, tuple[int, int]], Tensor]:
    """What a step reads of an fp64 tensor in ``block``: itself, or its FP8 form dequantized.

    The FP8 form is quantized from the tensor rounded to the module's dtype
    (fp32), as the module quantizes its own fp32 tensor.
    """

    def read(t64: Tensor, block: tuple[int, int]) -> Tensor:
        if recipe is None:
            return t64
        how = {"splits": splits} if block == TOKENS else {}
        blocks = quantize_fp8(t64.float(), block=block, **how)
        return torch.as_tensor(blocks.dequantize()).double()  # type: ignore[union-attr]

    return read


def _per_expert(splits: list[int], gemm: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
    """``gemm(e, *rows_of_e)`` for every expert, concatenated in row order."""
    parts = zip(*(t.split(splits) for t in tensors), strict=True)
    return torch.cat([gemm(e, *rows) for e, rows in enumerate(parts)])


def _reference(
    module: GroupedMLP,
    case: Case,
    x: torch.Tensor,
    probs: torch.Tensor | None,
    dy: torch.Tensor,
    splits: list[int],
) -> dict:
    """fp64 reference with PyTorch's SwiGLU: y, dx, dprobs, per-parameter dw and db."""
    fwd, bwd = (2.0, 4.0) if case.kind == "distributed" else (1.0, 1.0)
    read = _reader(module.fp8_recipe, splits)
    w1s, b1s = matrix.experts_fp64(module.fc1)
    w2s, b2s = matrix.experts_fp64(module.fc2)
    w1f, w1b = (read(scale * torch.stack(w1s), WEIGHTS) for scale in (fwd, bwd))
    w2f, w2b = (read(scale * torch.stack(w2s), WEIGHTS) for scale in (fwd, bwd))
    x64, dy64 = x.double(), dy.double()

    h = _per_expert(splits, lambda e, x_e: F.linear(x_e, w1f[e], b1s[e]), read(x64, ROWS))
    h = read(h, ROWS).requires_grad_()  # the h the SwiGLU reads, forward and backward
    p_all = torch.ones(x.shape[0], dtype=torch.float64) if probs is None else probs.double()
    p_all.requires_grad_()
    gate, up = h.chunk(2, dim=1)
    a = F.silu(gate) * up * p_all[:, None]
    a_fc2 = read(a.detach(), ROWS)
    y = _per_expert(splits, lambda e, a_e: F.linear(a_e, w2f[e], b2s[e]), a_fc2)
    da = _per_expert(splits, lambda e, d_e: d_e @ w2b[e], read(dy64, ROWS))
    dh, dp = torch.autograd.grad(a, [h, p_all], da)
    dx = _per_expert(splits, lambda e, d_e: d_e @ w1b[e], read(dh, ROWS))

    def wgrads(d_TN: Tensor, x_TK: Tensor) -> list[Tensor]:
        pairs = zip(read(d_TN, TOKENS).split(splits), read(x_TK, TOKENS).split(splits), strict=True)
        return [d_e.T @ x_e for d_e, x_e in pairs]

    def layout(per_expert: list[Tensor]) -> list[Tensor]:
        return [torch.stack(per_expert)] if case.layout == "single" else per_expert

    return {
        "y": y,
        "dx": dx,
        "dp": dp,
        "dw1": layout(wgrads(dh, x64)),
        "dw2": layout(wgrads(dy64, a.detach())),
        "db1": layout([d_e.sum(0) for d_e in dh.split(splits)]),  # the unquantized dh
        "db2": layout([d_e.sum(0) for d_e in dy64.split(splits)]),
    }


@pytest.mark.parametrize("recipe", [None, "blockwise"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_grouped_mlp_matrix(case: Case, recipe: str | None) -> None:
    module, weights = _build(case, seed=11, recipe=recipe)
    H, _ = SIZES[recipe]
    names = [f"fc1.{n}" for n in module.fc1.weight_names]
    names += [f"fc2.{n}" for n in module.fc2.weight_names]
    biases = [getattr(module.fc1, n) for n in module.fc1.bias_names]
    biases += [getattr(module.fc2, n) for n in module.fc2.bias_names]
    initial = [w.main_grad.clone() if case.main_grad != "none" else None for w in weights]
    sum_dw = [torch.zeros(w.shape, dtype=torch.float64) for w in weights]
    sum_db = [torch.zeros(b.shape, dtype=torch.float64) for b in biases]
    gen = torch.Generator().manual_seed(123)

    for step, (splits, with_probs) in enumerate(zip(SPLITS[recipe], WITH_PROBS, strict=True)):
        tokens = sum(splits)
        x = torch.randn(tokens, H, generator=gen).requires_grad_()
        probs = torch.rand(tokens, generator=gen).requires_grad_() if with_probs else None
        dy = torch.randn(tokens, H, generator=gen)
        ref = _reference(module, case, x.detach(), probs, dy, splits)

        y = module(x, splits, probs)
        matrix.assert_matrix_close(y, ref["y"], f"y at step {step}")
        before = [w.main_grad.clone() if case.main_grad != "none" else None for w in weights]
        grads_before = [None if w.grad is None else w.grad.clone() for w in weights]
        y.backward(dy)
        matrix.assert_matrix_close(x.grad, ref["dx"], f"dx at step {step}")
        if probs is not None:
            matrix.assert_matrix_close(probs.grad, ref["dp"], f"dprobs at step {step}")

        matrix.assert_main_grads_wait_for_backward_dw(case, weights, before)
        if case.delay and case.main_grad == "none":
            for w, old in zip(weights, grads_before, strict=True):
                unchanged = w.grad is None if old is None else torch.equal(w.grad, old)
                assert unchanged, "a delayed wgrad reached .grad before backward_dw()"
        module.backward_dw()

        latest = ref["dw1"] + ref["dw2"]
        for index, dw in enumerate(latest):
            sum_dw[index] += dw
        for index, db in enumerate(ref["db1"] + ref["db2"] if case.bias else []):
            sum_db[index] += db

        labels = [f"{name} at step {step}" for name in names]
        matrix.assert_weight_grads(
            case, weights, labels, latest=latest, total=sum_dw, initial=initial
        )
        for index, b in enumerate(biases):
            matrix.assert_matrix_close(b.grad, sum_db[index], f"bias grad {index} at step {step}")
        if case.kind == "distributed":
            # what each layer handed its implementer, against the fp64 oracle (not the fake)
            for layer, key in (("fc1", "dw1"), ("fc2", "dw2")):
                received = _layer_weights(module, layer)[0].finalized[-1]
                for index, dw in enumerate(ref[key]):
                    matrix.assert_matrix_close(
                        received[index], dw, f"{layer} wgrad handed to finalize, member {index}"
                    )
        elif case.main_grad != "none":
            matrix.write_into_dummies(weights, versioned=not case.zero_out)

    if case.kind == "distributed":
        for layer in ("fc1", "fc2"):
            leader = _layer_weights(module, layer)[0]
            assert isinstance(leader, FakeDistributedWeight)
            assert leader.calls["materialize_group_for_forward"] == len(WITH_PROBS), layer
            assert leader.calls["materialize_group_for_backward"] == len(WITH_PROBS), layer
            assert leader.calls["finalize_group_grads"] == len(WITH_PROBS), layer
            if case.main_grad != "none":
                assert all(g.dtype == torch.float32 for g in leader.finalized[-1]), layer
    if case.delay:
        with pytest.raises(
            RuntimeError, match=r"GroupedMLP\.backward_dw\(\) was called but no backward has queued"
        ):
            module.backward_dw()
