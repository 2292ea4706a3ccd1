"""routed_grouped_mlp on the CPU (reference kernels): results, memory rules, errors, compile.

Legend: ``T`` tokens, ``k`` choices per token, ``S = T·k`` slots, ``E``
experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from groupgrad.modules import grouped_mlp, routed_grouped_mlp
from groupgrad.protocol.testing import make_fake_group

T, K, E, H, F = 29, 3, 5, 32, 24


def _routing(tokens: int = T, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(ids, slots, splits, weights)``: top-k ids with expert 1 empty and one "no expert" choice."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (tokens, K), generator=g)
    ids[ids == 1] = 2  # expert 1 gets no token
    if tokens > 3:
        ids[3, 1] = E  # "no expert": rides along with the last expert at weight 0
    sorted_ids, slots = torch.sort(ids.reshape(-1), stable=True)
    splits = torch.bincount(sorted_ids.clamp(max=E - 1), minlength=E)
    weights = torch.rand(tokens, K, generator=g).softmax(-1).masked_fill(ids == E, 0)
    return ids, slots, splits, weights


def _params(dtype: torch.dtype, packed: bool, seed: int = 1) -> tuple[object, object, list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * F, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, F, generator=g) / F**0.5).to(dtype)
    if packed:
        leaves = [w1.requires_grad_(), w2.requires_grad_()]
        return leaves[0], leaves[1], leaves
    fc1 = [w.clone().requires_grad_() for w in w1.unbind(0)]
    fc2 = [w.clone().requires_grad_() for w in w2.unbind(0)]
    return fc1, fc2, fc1 + fc2


def _unrouted(x: Tensor, fc1: object, fc2: object, slots: Tensor, splits: Tensor, w: Tensor):
    """The same experts as gather, ``grouped_mlp`` and combine, three autograd steps."""
    tokens, k = w.shape
    y = grouped_mlp(x[slots // k], fc1, fc2, splits, w.reshape(-1)[slots])
    unsorted = torch.empty_like(y).index_copy(0, slots, y)
    return unsorted.view(tokens, k, -1).sum(dim=1, dtype=torch.float32).to(y.dtype)


def _grads(fn, x: Tensor, w: Tensor, leaves: list[Tensor], dy: Tensor) -> list[Tensor]:
    for t in (x, w, *leaves):
        t.grad = None
    out = fn()
    out.backward(dy)
    return [out.detach(), *(t.grad.clone() for t in (x, w, *leaves))]


@pytest.mark.parametrize("packed", [True, False])
def test_matches_gather_grouped_mlp_combine(packed: bool) -> None:
    _, slots, splits, weights = _routing()
    fc1, fc2, leaves = _params(torch.float32, packed)
    x = torch.randn(T, H).requires_grad_()
    w = weights.clone().requires_grad_()
    dy = torch.randn(T, H)
    ours = _grads(lambda: routed_grouped_mlp(x, fc1, fc2, slots, splits, w), x, w, leaves, dy)
    theirs = _grads(lambda: _unrouted(x, fc1, fc2, slots, splits, w), x, w, leaves, dy)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if not packed:  # expert 1 has no token: zero gradients
        assert not ours[3 + 1].any()
        assert not ours[3 + E + 1].any()


def test_bf16_weights_receive_fp32_gradients_from_the_gemm() -> None:
    _, slots, splits, weights = _routing()
    w1, w2, leaves = _params(torch.bfloat16, packed=True)
    for p in leaves:
        p.grad_dtype = torch.float32
    x = torch.randn(T, H, dtype=torch.bfloat16)
    routed_grouped_mlp(x, w1, w2, slots, splits, weights).float().square().sum().backward()
    for p in leaves:
        assert p.grad is not None
        assert p.grad.dtype == torch.float32
        exact = (p.grad.to(torch.bfloat16).float() == p.grad) & (p.grad != 0)
        assert exact.float().mean() < 0.01, "the wgrad was rounded to bf16 on its way"


def test_keeps_no_slot_sized_activation_and_frees_fc1_output() -> None:
    _, slots, splits, weights = _routing()
    w1, w2, _ = _params(torch.float32, packed=True)
    x = torch.randn(T, H).requires_grad_()
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = routed_grouped_mlp(x, w1, w2, slots, splits, weights)
    shapes = [tuple(t.shape) for t in saved]
    assert (T * K, H) not in shapes, shapes  # neither the gathered x nor an (S, H) output
    (h,) = [t for t in saved if tuple(t.shape) == (T * K, 2 * F)]
    out.sum().backward(retain_graph=True)
    assert h.untyped_storage().nbytes() == 0, "backward kept fc1's output until it returned"
    with pytest.raises(RuntimeError, match="second time over one forward"):
        out.sum().backward()


def test_zero_tokens() -> None:
    _, slots, splits, weights = _routing(tokens=0)
    w1, w2, leaves = _params(torch.float32, packed=True)
    x = torch.randn(0, H).requires_grad_()
    out = routed_grouped_mlp(x, w1, w2, slots, splits, weights)
    assert out.shape == (0, H)
    out.sum().backward()
    assert x.grad is not None
    assert x.grad.shape == (0, H)
    assert all(p.grad is not None and not p.grad.any() for p in leaves)


def test_autocast_matches_the_unrouted_chain() -> None:
    _, slots, splits, weights = _routing()
    w1, w2, leaves = _params(torch.float32, packed=True)
    x = torch.randn(T, H).requires_grad_()
    w = weights.clone().requires_grad_()
    dy = torch.randn(T, H)

    def under_autocast(fn):
        def run() -> Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn()

        return run

    ours = _grads(
        under_autocast(lambda: routed_grouped_mlp(x, w1, w2, slots, splits, w)), x, w, leaves, dy
    )
    theirs = _grads(
        under_autocast(lambda: _unrouted(x, w1, w2, slots, splits, w)), x, w, leaves, dy
    )
    assert ours[0].dtype == torch.bfloat16
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_delivers_fp32_wgrads_as_eager(dtype: torch.dtype) -> None:
    """Every gradient as eager's (torch 2.11 once traced fp32's to zero: an output aliasing)."""
    _, slots, splits, weights = _routing()
    w1, w2, leaves = _params(dtype, packed=True)
    for p in leaves:
        p.grad_dtype = torch.float32
    x0 = torch.randn(T, H, dtype=dtype)

    def step(fn) -> list[Tensor]:
        for p in leaves:
            p.grad = None
        x, w = x0.clone().requires_grad_(), weights.clone().requires_grad_()
        fn(x, w1, w2, slots, splits, w).float().square().sum().backward()
        return [*(p.grad.clone() for p in leaves), x.grad, w.grad]

    torch._dynamo.reset()
    compiled = step(torch.compile(routed_grouped_mlp, fullgraph=True))
    eager = step(routed_grouped_mlp)
    assert compiled[0].dtype == compiled[1].dtype == torch.float32
    for c, e in zip(compiled, eager, strict=True):
        assert e.abs().max() > 0
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("packed", [True, False])
def test_compiled_hook_on_an_fc1_weight_is_refused_before_fc2_is_written(packed: bool) -> None:
    # Catches: fc2's compiled op writing fc2's .grad before fc1's op refused the hook on an
    # fc1 weight (the op hands its layers over one after the other): half a backward landed.
    _, slots, splits, weights = _routing()
    w1, w2, leaves = _params(torch.float32, packed=packed)
    hooked = leaves[0] if packed else leaves[E - 1]
    hooked.register_hook(lambda g: g * 0)
    name = "fc1_weights" if packed else rf"fc1_weights\[{E - 1}\]"
    step = torch.compile(routed_grouped_mlp, fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=rf"^a gradient hook .* is on {name}, .*torch\.compile"):
        step(torch.randn(T, H), w1, w2, slots, splits, weights).sum().backward()
    assert all(p.grad is None for p in leaves)  # fc2's too: nothing of the backward written


def _call(**change: object) -> None:
    _, slots, splits, weights = _routing()
    w1, w2, _ = _params(torch.float32, packed=True)
    args: dict[str, object] = {
        "x": torch.randn(T, H),
        "fc1_weights": w1,
        "fc2_weights": w2,
        "slots": slots,
        "splits": splits,
        "top_k_weights": weights,
    } | change
    routed_grouped_mlp(**args)  # type: ignore[arg-type]


def _repeated() -> Tensor:
    slots = _routing()[1].clone()
    slots[0] = slots[1]
    return slots


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"slots": _repeated()}, ValueError, "slots repeats a slot"),
        ({"slots": _routing()[1] + 1}, ValueError, r"slots holds a slot outside \[0, 87\)"),
        ({"slots": _routing()[1].float()}, TypeError, "slots is torch.float32, expected an int64"),
        ({"slots": _routing()[1][:-1]}, ValueError, r"slots has shape \(86,\), expected \(87,\)"),
        ({"top_k_weights": torch.ones(T, K, dtype=torch.int64)}, TypeError, "top_k_weights is"),
        ({"top_k_weights": torch.rand(T - 1, K)}, ValueError, r"expected \(29, k\)"),
        ({"x": torch.randn(T, H + 1)}, ValueError, r"x has shape \(29, 33\)"),
        ({"splits": [T * K - 2, 1, 0, 0, 0]}, ValueError, "splits"),
        ({"activation": "gelu"}, ValueError, "activation is 'gelu'"),
    ],
)
def test_bad_inputs_are_named(change: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _call(**change)


@pytest.mark.parametrize("layer", ["fc1", "fc2"])
def test_a_distributed_group_is_refused_whichever_layer_has_it(layer: str) -> None:
    # Catches: a distributed fc2 alone met "needs fc1 and fc2 both distributed or both plain",
    # advice whose following met the refusal of distributed groups.
    w1, w2, _ = _params(torch.float32, packed=False)
    weights: dict[str, object] = {"fc1_weights": w1, "fc2_weights": w2}
    weights[f"{layer}_weights"] = make_fake_group(list(weights[f"{layer}_weights"]))  # type: ignore[call-overload]
    with pytest.raises(
        TypeError,
        match=rf"^{layer}_weights\[0\] is a DistributedWeight; "
        r"routed_grouped_mlp takes plain weights",
    ):
        _call(**weights)


def test_int32_slots_give_the_int64_result() -> None:
    # Catches: int32 slots (the docstring takes them) reaching the index ops, which want int64:
    # an IndexError in eager code.
    _, slots, splits, weights = _routing()
    w1, w2, leaves = _params(torch.float32, packed=True)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    results = []
    for s in (slots, slots.int()):
        for p in leaves:
            p.grad = None
        y = routed_grouped_mlp(x, w1, w2, s, splits, weights)
        y.square().sum().backward()
        results.append([y, *(p.grad for p in leaves)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("bad", "message"),
    [("repeated", "slots repeats a slot"), ("outside", r"slots holds a slot outside \[0, T")],
)
def test_compiled_calls_check_the_slots_too(bad: str, message: str) -> None:
    # Catches: the permutation check skipped while compiling: a repeated slot left a token's
    # output row as uninitialised memory, an outside one failed deep in a generated kernel.
    torch._dynamo.reset()
    _, slots, splits, weights = _routing()
    slots = _repeated() if bad == "repeated" else slots + 1
    w1, w2, _ = _params(torch.float32, packed=True)
    step = torch.compile(routed_grouped_mlp, fullgraph=True)
    with pytest.raises(RuntimeError, match=message):
        step(torch.randn(T, H), w1, w2, slots, splits, weights)
