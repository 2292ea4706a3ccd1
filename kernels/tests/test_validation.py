"""Every rejected call raises a named error and writes nothing.

Each case starts from a valid call (bf16 inputs, ``out`` given and filled with
a sentinel), breaks one argument, and checks the exception type, its message
(``match``) and that whatever ``out`` the call received is unchanged. Each
case runs against the public kernel and its reference twin. The ``meta``
device stands in for "another device" on a CPU-only machine.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from groupgrad_testsupport.gemms import GEMMS

SPLITS = [3, 0, 5, 4]
E, T, N, K = 4, 12, 8, 16
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SENTINEL = 7.0


def rand(*shape: int, dtype: torch.dtype = BF16) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


def full(*shape: int, dtype: torch.dtype = BF16) -> Tensor:
    return torch.full(shape, SENTINEL, dtype=dtype)


def packed_out_holding_x(args: dict) -> None:
    """A bf16 ``(E, N, K)`` out whose memory also holds ``x``."""
    out = full(E, N, K)
    args.update(out=out, x=out.view(-1)[: T * K].view(T, K))


def out_inside_padded_x(args: dict) -> None:
    """``x`` row-major with padded rows (stride ``2K``: it spans more than its bytes) and a
    contiguous ``out`` lying in the memory of its later rows."""
    base = rand(T, 2 * K)
    args.update(x=base[:, :K], out=base.view(-1)[T * K :][: T * N].view(T, N))


def packed_out_inside_padded_x(args: dict) -> None:
    """A contiguous bf16 ``(E, N, K)`` out lying in the memory of a row-padded ``x``'s later rows."""
    base = rand(-(-(T * K + E * N * K) // (2 * K)), 2 * K)
    args.update(x=base[:T, :K], out=base.view(-1)[T * K :][: E * N * K].view(E, N, K))


def column_major(t: Tensor) -> Tensor:
    return t.mT.contiguous().mT


def valid_args(op: str) -> dict[str, Any]:
    if op == "fprop":
        return {"x": rand(T, K), "weights": rand(E, N, K), "splits": SPLITS, "out": full(T, N)}
    if op == "dgrad":
        return {"dy": rand(T, N), "weights": rand(E, N, K), "splits": SPLITS, "out": full(T, K)}
    return {
        "dy": rand(T, N),
        "x": rand(T, K),
        "splits": SPLITS,
        "out": [full(N, K, dtype=FP32) for _ in range(E)],
    }


@dataclass
class Case:
    id: str
    op: str
    change: Callable[[dict[str, Any]], object]
    error: type[Exception]
    match: str


def weights_list(a: dict[str, Any], e: int, member: object) -> None:
    members = list(a["weights"].unbind(0))
    members[e] = member
    a["weights"] = members


def out_member(a: dict[str, Any], e: int, member: object) -> None:
    a["out"][e] = member


def alike_overlapping(dtype: torch.dtype) -> list[Tensor]:
    """``E`` contiguous ``(N, K)`` views of one buffer, each starting 4 elements before the last ends."""
    flat = full(E * N * K, dtype=dtype)
    return [flat[e * (N * K - 4) :][: N * K].view(N, K) for e in range(E)]


def alike_member_inside_dy(a: dict[str, Any]) -> None:
    """bf16 outputs, all alike; ``out[2]`` starts inside ``dy``'s memory."""
    buffer = rand(T * N + N * K)
    a["dy"] = buffer[: T * N].view(T, N)
    a["out"] = [full(N, K) for _ in range(E)]
    a["out"][2] = buffer[T * N - 3 :][: N * K].view(N, K)


def alike_member_before_x(a: dict[str, Any]) -> None:
    """bf16 outputs, all alike; ``out[1]`` ends inside ``x``'s memory."""
    buffer = rand(N * K + T * K)
    a["out"] = [full(N, K) for _ in range(E)]
    a["out"][1] = buffer[: N * K].view(N, K)
    a["x"] = buffer[N * K - 1 :][: T * K].view(T, K)


def out_inside_alike_weight(a: dict[str, Any]) -> None:
    """Listed weights, all alike; ``out`` starts inside ``weights[2]``."""
    buffer = rand(N * K + T * N)
    weights = list(a["weights"].unbind(0))
    weights[2] = buffer[: N * K].view(N, K)
    a["weights"], a["out"] = weights, buffer[N * K // 2 :][: T * N].view(T, N)


CASES = [
    # fprop: x
    Case("x-not-tensor", "fprop", lambda a: a.update(x=a["x"].tolist()), TypeError,
         r"x must be a torch\.Tensor, got list"),
    Case("x-int", "fprop", lambda a: a.update(x=a["x"].int()), TypeError,
         r"x has dtype torch\.int32, expected torch\.bfloat16, torch\.float16 or torch\.float32"),
    Case("x-3d", "fprop", lambda a: a.update(x=a["x"][None]), ValueError,
         r"x must be 2-D \(T, K\), got shape \(1, 12, 16\)"),
    Case("x-column-major", "fprop", lambda a: a.update(x=column_major(a["x"])), ValueError,
         r"x must be row-major \(stride 1 in the last dimension\), got shape \(12, 16\) "
         r"with strides \(1, 12\)"),
    # Catches: a sparse, mkldnn or nested operand reaching torch's internals (an error about
    # data pointers or strides) or the reference kernel, unnamed.
    Case("x-sparse-csr", "fprop", lambda a: a.update(x=a["x"].float().to_sparse_csr()), TypeError,
         r"^x is a torch\.sparse_csr tensor, expected a dense \(torch\.strided\) one"),
    Case("x-nested", "fprop", lambda a: a.update(x=torch.nested.nested_tensor([a["x"], a["x"]])),
         TypeError, r"^x is a nested tensor, expected a dense \(torch\.strided\) one"),
    Case("wgrad-x-mkldnn", "wgrad", lambda a: a.update(x=a["x"].float().to_mkldnn()), TypeError,
         r"^x is a torch\._mkldnn tensor, expected a dense"),
    Case("weights-sparse", "fprop", lambda a: a.update(weights=a["weights"].to_sparse()),
         TypeError, r"^weights is a torch\.sparse_coo tensor, expected a dense"),
    Case("splits-sparse", "fprop", lambda a: a.update(splits=torch.tensor(SPLITS).to_sparse()),
         TypeError, r"^splits is a torch\.sparse_coo tensor, expected a dense"),
    Case("out-mkldnn", "fprop", lambda a: a.update(out=a["out"].float().to_mkldnn()), TypeError,
         r"^out is a torch\._mkldnn tensor, expected a dense"),
    Case("weights-member-mkldnn", "fprop",
         lambda a: weights_list(a, 1, rand(N, K, dtype=FP32).to_mkldnn()), TypeError,
         r"^weights\[1\] is a torch\._mkldnn tensor, expected a dense"),
    Case("weights-nested", "fprop",
         lambda a: a.update(weights=torch.nested.nested_tensor(list(a["weights"]))), TypeError,
         r"^weights is a nested tensor, expected a dense"),
    Case("out-member-mkldnn", "wgrad",
         lambda a: out_member(a, 1, full(N, K, dtype=FP32).to_mkldnn()), TypeError,
         r"^out\[1\] is a torch\._mkldnn tensor, expected a dense"),
    Case("out-member-sparse-csr", "wgrad",
         lambda a: out_member(a, 1, full(N, K, dtype=FP32).to_sparse_csr()), TypeError,
         r"^out\[1\] is a torch\.sparse_csr tensor, expected a dense"),
    Case("out-nested", "wgrad", lambda a: a.update(out=torch.nested.nested_tensor(a["out"])),
         TypeError, r"^out is a nested tensor, expected a dense"),
    Case("x-K", "fprop", lambda a: a.update(x=rand(T, K + 1)), ValueError,
         r"x has 17 columns, expected K = 16 like weights of shape \(E, N, K\) = \(4, 8, 16\)"),
    # fprop: weights
    Case("weights-member-dtype", "fprop", lambda a: weights_list(a, 3, rand(N, K, dtype=FP16)),
         TypeError, r"weights\[3\] has dtype torch\.float16, expected torch\.bfloat16 like "
         r"weights\[0\]"),
    Case("weights-dtype", "fprop", lambda a: a.update(weights=a["weights"].half()), TypeError,
         r"weights has dtype torch\.float16, expected torch\.bfloat16 like x"),
    Case("weights-device", "fprop",
         lambda a: weights_list(a, 1, torch.empty(N, K, dtype=BF16, device="meta")),
         ValueError, r"weights\[1\] is on meta, expected cpu like x"),
    Case("weights-member-shape", "fprop", lambda a: weights_list(a, 2, rand(N, K - 1)),
         ValueError, r"weights\[2\] has shape \(8, 15\), expected \(8, 16\) like weights\[0\]"),
    Case("weights-member-3d", "fprop", lambda a: weights_list(a, 0, rand(1, N, K)), ValueError,
         r"weights\[0\] must be 2-D \(N, K\), got shape \(1, 8, 16\)"),
    Case("weights-member-not-tensor", "fprop", lambda a: weights_list(a, 1, [1.0]), TypeError,
         r"weights\[1\] must be a torch\.Tensor, got list"),
    Case("weights-2d", "fprop", lambda a: a.update(weights=rand(N, K)), ValueError,
         r"weights must be an \(E, N, K\) tensor or a sequence of E \(N, K\) tensors, "
         r"got a tensor of shape \(8, 16\)"),
    Case("weights-empty", "fprop", lambda a: a.update(weights=[]), ValueError,
         r"weights holds no experts"),
    Case("weights-int", "fprop", lambda a: a.update(weights=3), TypeError,
         r"weights must be an \(E, N, K\) tensor or a sequence of E \(N, K\) tensors, got int"),
    Case("weights-column-major", "fprop",
         lambda a: a.update(weights=column_major(a["weights"])), ValueError,
         r"weights must be row-major"),
    # fprop: splits
    Case("splits-length", "fprop", lambda a: a.update(splits=[3, 0, 9]), ValueError,
         r"splits has 3 entries but weights has 4 experts"),
    Case("splits-negative", "fprop", lambda a: a.update(splits=[3, -2, 7, 4]), ValueError,
         r"splits\[1\] is -2, expected a token count >= 0"),
    Case("splits-sum", "fprop", lambda a: a.update(splits=[3, 0, 5, 3]), ValueError,
         r"splits sums to 11 but x has 12 rows"),
    Case("splits-sum-cpu-tensor", "fprop", lambda a: a.update(splits=torch.tensor([3, 0, 5, 5])),
         ValueError, r"splits sums to 13 but x has 12 rows"),
    Case("splits-negative-int32", "fprop",
         lambda a: a.update(splits=torch.tensor([3, 0, -5, 14], dtype=torch.int32)), ValueError,
         r"splits\[2\] is -5"),
    Case("splits-float-tensor", "fprop", lambda a: a.update(splits=torch.tensor([3.0, 0, 5, 4])),
         TypeError, r"splits has dtype torch\.float32, expected torch\.int32 or torch\.int64"),
    Case("splits-2d", "fprop", lambda a: a.update(splits=torch.tensor([SPLITS])), ValueError,
         r"splits must be 1-D \(E,\), got shape \(1, 4\)"),
    Case("splits-device", "fprop",
         lambda a: a.update(splits=torch.empty(E, dtype=torch.int64, device="meta")), ValueError,
         r"splits is on meta, expected cpu like x"),
    Case("splits-float-member", "fprop", lambda a: a.update(splits=[3, 0.5, 5, 4]), TypeError,
         r"splits\[1\] must be an int, got float"),
    Case("splits-bool-member", "fprop", lambda a: a.update(splits=[3, True, 5, 4]), TypeError,
         r"splits\[1\] must be an int, got bool"),
    Case("splits-none", "fprop", lambda a: a.update(splits=None), TypeError,
         r"splits must be a sequence of ints or an integer tensor, got NoneType"),
    # sets and dicts have no expert order; a generator is read once (and returned spent)
    Case("splits-set", "fprop", lambda a: a.update(splits=set(SPLITS)), TypeError,
         r"splits must be a sequence of ints or an integer tensor, got set"),
    Case("weights-set", "fprop", lambda a: a.update(weights=set(a["weights"].unbind(0))),
         TypeError, r"weights must be an \(E, N, K\) tensor or a sequence of E \(N, K\) "
         r"tensors, got set"),
    Case("weights-dict", "dgrad", lambda a: a.update(weights=dict(enumerate(a["weights"]))),
         TypeError, r"weights must be .*, got dict"),
    # fprop: out
    Case("out-shape", "fprop", lambda a: a.update(out=full(T, N + 1)), ValueError,
         r"out has shape \(12, 9\), expected \(T, N\) = \(12, 8\)"),
    Case("out-dtype", "fprop", lambda a: a.update(out=full(T, N, dtype=FP32)), TypeError,
         r"out has dtype torch\.float32, expected torch\.bfloat16 like x"),
    Case("out-device", "fprop",
         lambda a: a.update(out=torch.empty(T, N, dtype=BF16, device="meta")), ValueError,
         r"out is on meta, expected cpu like x"),
    Case("out-not-tensor", "fprop", lambda a: a.update(out=[full(T, N)]), TypeError,
         r"out must be a torch\.Tensor, got list"),
    Case("out-column-major", "fprop", lambda a: a.update(out=column_major(a["out"])),
         ValueError, r"out must be row-major"),
    Case("out-overlaps-x", "fprop", lambda a: a.update(out=a["x"][:, :N]), ValueError,
         r"out overlaps x in memory; outputs must not overlap each other or the inputs"),
    Case("out-inside-padded-x", "fprop", out_inside_padded_x, ValueError,
         r"out overlaps x in memory"),
    Case("out-overlaps-weights", "fprop",
         lambda a: a.update(out=a["weights"].view(-1)[: T * N].view(T, N)), ValueError,
         r"out overlaps weights in memory"),
    # dgrad
    Case("dy-N", "dgrad", lambda a: a.update(dy=rand(T, N + 1)), ValueError,
         r"dy has 9 columns, expected N = 8 like weights of shape \(E, N, K\) = \(4, 8, 16\)"),
    Case("dy-not-2d", "dgrad", lambda a: a.update(dy=rand(T * N)), ValueError,
         r"dy must be 2-D \(T, N\), got shape \(96,\)"),
    Case("dgrad-splits-sum", "dgrad", lambda a: a.update(splits=[3, 0, 5, 5]), ValueError,
         r"splits sums to 13 but dy has 12 rows"),
    Case("dgrad-out-shape", "dgrad", lambda a: a.update(out=full(T, N)), ValueError,
         r"out has shape \(12, 8\), expected \(T, K\) = \(12, 16\)"),
    Case("dgrad-weights-dtype", "dgrad", lambda a: a.update(dy=rand(T, N, dtype=FP32)),
         TypeError, r"weights has dtype torch\.bfloat16, expected torch\.float32 like dy"),
    Case("dgrad-out-overlaps-dy", "dgrad", lambda a: a.update(out=a["out"], dy=a["out"][:, :N]),
         ValueError, r"out overlaps dy in memory"),
    # wgrad: inputs
    Case("wgrad-rows", "wgrad", lambda a: a.update(x=rand(T - 1, K)), ValueError,
         r"x has 11 rows but dy has 12 rows"),
    Case("wgrad-x-dtype", "wgrad", lambda a: a.update(x=rand(T, K, dtype=FP16)), TypeError,
         r"x has dtype torch\.float16, expected torch\.bfloat16 like dy"),
    Case("wgrad-x-device", "wgrad",
         lambda a: a.update(x=torch.empty(T, K, dtype=BF16, device="meta")), ValueError,
         r"x is on meta, expected cpu like dy"),
    Case("wgrad-dy-float64", "wgrad", lambda a: a.update(dy=a["dy"].double()), TypeError,
         r"dy has dtype torch\.float64, expected torch\.bfloat16, torch\.float16 or "
         r"torch\.float32"),
    Case("wgrad-splits-sum", "wgrad", lambda a: a.update(splits=[3, 0, 5, 3]), ValueError,
         r"splits sums to 11 but x has 12 rows"),
    Case("wgrad-splits-empty", "wgrad",
         lambda a: a.update(dy=rand(0, N), x=rand(0, K), splits=[], out=None), ValueError,
         r"splits has no entries, expected one token count per expert"),
    # wgrad: out, out_dtype, accumulate
    Case("out-length", "wgrad", lambda a: a["out"].pop(), ValueError,
         r"out has 3 tensors but splits has 4 entries"),
    Case("out-member-dtype", "wgrad", lambda a: out_member(a, 2, full(N, K)), TypeError,
         r"out\[2\] has dtype torch\.bfloat16, expected torch\.float32 like out\[0\]"),
    Case("out-int", "wgrad", lambda a: out_member(a, 0, full(N, K, dtype=torch.int64)),
         TypeError, r"out\[0\] has dtype torch\.int64, expected torch\.bfloat16, torch\.float16 "
         r"or torch\.float32"),
    Case("out-dtype-invalid", "wgrad", lambda a: a.update(out_dtype=torch.int8), TypeError,
         r"out_dtype is torch\.int8, expected torch\.bfloat16, torch\.float16 or torch\.float32 "
         r"or None"),
    Case("out-dtype-mismatch", "wgrad", lambda a: a.update(out_dtype=BF16), TypeError,
         r"out\[0\] has dtype torch\.float32 but out_dtype is torch\.bfloat16"),
    Case("out-tensor-dtype-mismatch", "wgrad",
         lambda a: a.update(out=full(E, N, K, dtype=FP32), out_dtype=FP16), TypeError,
         r"out has dtype torch\.float32 but out_dtype is torch\.float16"),
    Case("out-member-shape", "wgrad", lambda a: out_member(a, 1, full(N, K - 1, dtype=FP32)),
         ValueError, r"out\[1\] has shape \(8, 15\), expected \(N, K\) = \(8, 16\)"),
    Case("out-tensor-shape", "wgrad", lambda a: a.update(out=full(E - 1, N, K, dtype=FP32)),
         ValueError, r"out has shape \(3, 8, 16\), expected \(E, N, K\) = \(4, 8, 16\)"),
    Case("out-member-device", "wgrad",
         lambda a: out_member(a, 1, torch.empty(N, K, device="meta")), ValueError,
         r"out\[1\] is on meta, expected cpu like dy"),
    Case("out-member-not-tensor", "wgrad", lambda a: out_member(a, 1, None), TypeError,
         r"out\[1\] must be a torch\.Tensor, got NoneType"),
    Case("out-not-sequence", "wgrad", lambda a: a.update(out=3), TypeError,
         r"out must be an \(E, N, K\) tensor or a sequence of E \(N, K\) tensors, got int"),
    Case("out-member-column-major", "wgrad",
         lambda a: out_member(a, 2, column_major(full(N, K, dtype=FP32))), ValueError,
         r"out\[2\] must be row-major"),
    Case("out-members-alias", "wgrad", lambda a: out_member(a, 1, a["out"][0]), ValueError,
         r"out\[[01]\] overlaps out\[[01]\] in memory"),
    Case("out-members-overlap", "wgrad",
         lambda a: a.update(out=list(full(E * N + 1, K, dtype=FP32).unfold(0, N, N - 1)
                                     .permute(0, 2, 1)[:E])),
         ValueError, r"out\[\d\] overlaps out\[\d\] in memory"),
    Case("out-expanded", "wgrad", lambda a: a.update(out=full(1, N, K, dtype=FP32).expand(E, N, K)),
         ValueError, r"out\[\d\] overlaps out\[\d\] in memory"),
    Case("out-packed-interleaved", "wgrad",
         lambda a: a.update(out=full(N, E, K, dtype=FP32).permute(1, 0, 2)), ValueError,
         r"out\[1\] overlaps out\[0\] in memory"),
    Case("out-generator", "wgrad", lambda a: a.update(out=iter(a["out"])), TypeError,
         r"out must be an \(E, N, K\) tensor or a sequence of E \(N, K\) tensors, got "
         r"list_iterator"),
    Case("out-set", "wgrad", lambda a: a.update(out=set(a["out"])), TypeError,
         r"out must be .*, got set"),
    Case("out-packed-overlaps-x", "wgrad", packed_out_holding_x, ValueError,
         r"out overlaps x in memory"),
    Case("out-packed-inside-padded-x", "wgrad", packed_out_inside_padded_x, ValueError,
         r"out overlaps x in memory"),
    Case("out-overlaps-x", "wgrad",
         lambda a: a.update(out=[a["x"].view(-1)[: N * K].view(N, K),
                                 *[full(N, K) for _ in range(E - 1)]]),
         ValueError, r"out\[0\] overlaps x in memory"),
    # listed groups of alike contiguous members take the lean overlap sweep
    Case("out-alike-members-overlap", "wgrad", lambda a: a.update(out=alike_overlapping(FP32)),
         ValueError, r"out\[\d\] overlaps out\[\d\] in memory"),
    Case("out-alike-member-overlaps-dy", "wgrad", alike_member_inside_dy, ValueError,
         r"out\[2\] overlaps dy in memory"),
    Case("out-alike-member-holds-x", "wgrad", alike_member_before_x, ValueError,
         r"out\[1\] overlaps x in memory"),
    Case("out-overlaps-alike-weights", "fprop", out_inside_alike_weight, ValueError,
         r"out overlaps weights\[2\] in memory"),
    Case("out-overlaps-x-alike-weights", "fprop",
         lambda a: a.update(weights=list(a["weights"].unbind(0)), out=a["x"][:, :N]), ValueError,
         r"out overlaps x in memory"),
    Case("dgrad-out-overlaps-dy-alike-weights", "dgrad",
         lambda a: a.update(weights=list(a["weights"].unbind(0)), dy=a["out"][:, :N]),
         ValueError, r"out overlaps dy in memory"),
    Case("accumulate-without-out", "wgrad", lambda a: a.update(out=None, accumulate=True),
         ValueError, r"accumulate=True needs out: there is nothing to accumulate into"),
    Case("accumulate-not-bool", "wgrad", lambda a: a.update(accumulate="yes"), TypeError,
         r"accumulate is 'yes' \(str\), expected a bool"),
    # inputs autograd would record: the kernels are not differentiable (grad mode is on)
    Case("x-requires-grad", "fprop", lambda a: a["x"].requires_grad_(), ValueError,
         r"^x requires grad, but grouped_fprop is not differentiable: autograd would give x no "
         r"gradient"),
    Case("weights-requires-grad", "dgrad", lambda a: a["weights"].requires_grad_(), ValueError,
         r"^weights(\[0\])? requires grad, but grouped_dgrad is not differentiable"),
    Case("weights-member-requires-grad", "fprop",
         lambda a: weights_list(a, 2, rand(N, K).requires_grad_()), ValueError,
         r"^weights\[2\] requires grad, but grouped_fprop is not differentiable"),
    Case("weights-odd-member-requires-grad", "dgrad",
         lambda a: weights_list(a, 3, rand(N, 2 * K)[:, :K].requires_grad_()), ValueError,
         r"^weights\[3\] requires grad, but grouped_dgrad"),
    Case("wgrad-dy-requires-grad", "wgrad", lambda a: a["dy"].requires_grad_(), ValueError,
         r"^dy requires grad, but grouped_wgrad is not differentiable"),
    Case("wgrad-x-requires-grad", "wgrad", lambda a: a["x"].requires_grad_(), ValueError,
         r"^x requires grad, but grouped_wgrad is not differentiable"),
]  # fmt: skip


def snapshot(out: object) -> list[Tensor]:
    if isinstance(out, Tensor):
        out = [out]
    if isinstance(out, list | tuple):
        dense = [t for t in out if isinstance(t, Tensor) and t.layout == torch.strided]
        return [t.clone() for t in dense if t.device.type != "meta" and not t.is_nested]
    return []


SPLITS_FORMS = {  # the list takes the naming branch of splits' rule, a tensor its cheap test
    "list": lambda: SPLITS,
    "cpu_tensor": lambda: torch.tensor(SPLITS),
    "int32_tensor": lambda: torch.tensor(SPLITS, dtype=torch.int32),
}


@pytest.mark.parametrize("splits_form", list(SPLITS_FORMS))
@pytest.mark.parametrize("impl", list(GEMMS))
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_rejected_call_raises_and_writes_nothing(case, impl, splits_form):
    """Each misfit is named, with valid ``splits`` of each form beside it (and nothing written)."""
    args = valid_args(case.op)
    args["splits"] = SPLITS_FORMS[splits_form]()
    getattr(GEMMS[impl], case.op)(**args)  # the unchanged call is valid
    args = valid_args(case.op)
    args["splits"] = SPLITS_FORMS[splits_form]()
    case.change(args)
    before = snapshot(args.get("out"))
    with pytest.raises(case.error, match=case.match):
        getattr(GEMMS[impl], case.op)(**args)
    after = snapshot(args.get("out"))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "out was written"


def test_device_splits_on_the_reference_path_are_checked_when_read():
    """A tensor ``splits`` that skipped the host check is still checked by the reference."""
    from groupgrad.kernels import _ops

    x, w_ENK, out = rand(T, K), rand(E, N, K), full(T, N)
    with pytest.raises(ValueError, match=r"splits sums to 11 but x has 12 rows"):
        _ops.grouped_fprop_op(x, [w_ENK], torch.tensor([3, 0, 5, 3]), out)
    assert torch.equal(out, full(T, N))


@pytest.mark.parametrize("impl", list(GEMMS))
def test_alike_members_that_only_touch_are_not_overlapping(impl):
    """Back to back in one buffer — ``dy``, every ``out[e]``, ``x`` — is valid: ranges meet, never overlap."""
    wgrad = GEMMS[impl].wgrad
    dy, x = rand(T, N), rand(T, K)
    buffer = torch.empty(T * N + E * N * K + T * K, dtype=BF16)
    dy_in = buffer[: T * N].view(T, N)
    out = [buffer[T * N + e * N * K :][: N * K].view(N, K) for e in range(E)]
    x_in = buffer[T * N + E * N * K :].view(T, K)
    dy_in.copy_(dy)
    x_in.copy_(x)
    wgrad(dy_in, x_in, SPLITS, out=out)
    expected = GEMMS["ref"].wgrad(dy, x, SPLITS)
    assert all(torch.equal(o, e) for o, e in zip(out, expected.unbind(0), strict=True))
    assert torch.equal(dy_in, dy)
    assert torch.equal(x_in, x)


@pytest.mark.parametrize("op", ["fprop", "wgrad"])
def test_the_validator_checks_cpu_splits_values_itself(op):
    """Not left to the reference kernel: the CUTLASS path never reads ``splits``."""
    from groupgrad.kernels import _validate

    bad = torch.tensor([3, 0, 5, 5])
    calls = {
        "fprop": lambda: _validate.grouped_call("fprop", rand(T, K), rand(E, N, K), bad, None),
        "wgrad": lambda: _validate.wgrad_call(rand(T, N), rand(T, K), bad, None, None, False),
    }
    with pytest.raises(ValueError, match=r"splits sums to 13 but x has 12 rows"):
        calls[op]()


def test_a_listed_wgrad_runs_the_overlap_rule_once_naming_its_members(monkeypatch) -> None:
    """One check of ``out`` per call, with the caller's names (the modules pass
    ``weight3.main_grad``): a second pass, or a lost name, fails here."""
    import groupgrad.kernels._group as group_module
    from groupgrad.kernels import grouped_wgrad, prepare_wgrad

    seen: list[str] = []
    real = group_module.check_group_apart

    def spy(label, *args):
        seen.append(label(0) if callable(label) else label)
        return real(label, *args)

    monkeypatch.setattr(group_module, "check_group_apart", spy)
    dy, x = torch.randn(7, 4), torch.randn(7, 3)
    outs = [torch.zeros(4, 3) for _ in range(2)]
    names = ["weight0.main_grad", "weight1.main_grad"]
    prepared = prepare_wgrad(dy, x, [3, 4], out=outs, accumulate=True, names=names)
    assert seen == ["weight0.main_grad"]
    prepared.run()
    assert seen == ["weight0.main_grad"]  # running checks nothing again
    torch.testing.assert_close(outs[1], dy[3:].T @ x[3:])
    with pytest.raises(RuntimeError, match=r"ran already"):
        prepared.run()  # accumulating twice would add the gradient twice
    torch.testing.assert_close(outs[1], dy[3:].T @ x[3:])
    outs[1] = outs[0]
    with pytest.raises(ValueError, match=r"weight1\.main_grad overlaps weight0\.main_grad"):
        grouped_wgrad(dy, x, [3, 4], out=outs, names=names)


@pytest.mark.parametrize("impl", list(GEMMS))
def test_inputs_that_require_grad_are_fine_without_grad_mode(impl):
    """The rule is autograd's recording, not the flag: under no_grad the same call runs."""
    x, w = rand(T, K).requires_grad_(), rand(E, N, K).requires_grad_()
    with torch.no_grad():
        y = GEMMS[impl].fprop(x=x, weights=w, splits=SPLITS)
    assert torch.equal(y, GEMMS[impl].fprop(x=x.detach(), weights=w.detach(), splits=SPLITS))
