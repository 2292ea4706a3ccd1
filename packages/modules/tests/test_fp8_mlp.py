"""``fp8_recipe="blockwise"`` on ``GroupedMLP`` and ``grouped_mlp`` beyond the matrix.

The matrix (``test_mlp_matrix.py``) runs every combination of DESIGN's
options in FP8 against an fp64 chain of the dequantized operands. Here: the
recipe and size errors, the weight caches (``is_first_microbatch``), what
backward keeps (bytes per token, the recomputed ``a``, the deferred wgrads
served from the saved FP8 forms), four micro-batches into fp32 ``main_grad``,
activation recompute, autocast, the functional op, checkpoints, and
``torch.compile`` delivering the eager fp32 wgrads. Everything runs the
kernels' reference on the CPU.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import Tensor, nn

from groupgrad.modules import GroupedMLP, grouped_mlp
from groupgrad.protocol.testing import make_fake_group
from groupgrad_testsupport.calls import token_quantizations, weight_quantizations
from groupgrad_testsupport.compiled import assert_keeps_fp32, bf16_exact_share
from groupgrad_testsupport.mlp_reference import fp8_mlp_wgrads, mlp_reference

E, H, FFN = 4, 128, 128
SPLITS = [140, 0, 37, 23]  # an expert of two token blocks, an empty one
T = sum(SPLITS)
BF16 = torch.bfloat16
FP8 = {"fp8_recipe": "blockwise"}


def _randn(*shape: int, seed: int, dtype: torch.dtype = BF16) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _probs(seed: int = 9) -> Tensor:
    return torch.rand(T, generator=torch.Generator().manual_seed(seed))


def _mlp(**options: object) -> GroupedMLP:
    torch.manual_seed(0)
    return GroupedMLP(E, H, FFN, **{"dtype": BF16, **FP8, **options})  # type: ignore[arg-type]


def _y(mlp: GroupedMLP, x: Tensor, flag: bool | None) -> Tensor:
    with torch.no_grad():
        return mlp(x, SPLITS, _probs(), is_first_microbatch=flag)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("recipe", ["tensorwise", "Blockwise", True, 8])
def test_an_unknown_recipe_names_the_supported_ones(recipe: object) -> None:
    message = rf"^fp8_recipe is {recipe!r}, expected None or one of: 'blockwise'$"
    with pytest.raises(ValueError, match=message):
        GroupedMLP(E, H, FFN, fp8_recipe=recipe)  # type: ignore[arg-type]
    w1, w2 = _randn(E, 2 * FFN, H, seed=2), _randn(E, H, FFN, seed=3)
    with pytest.raises(ValueError, match=message):
        grouped_mlp(_randn(T, H, seed=1), w1, w2, SPLITS, fp8_recipe=recipe)  # type: ignore[arg-type]
    mlp = GroupedMLP(E, H, FFN)  # the attribute set after construction: its forward says so
    mlp.fp8_recipe = recipe  # type: ignore[assignment]
    with pytest.raises(ValueError, match=message):
        mlp(_randn(T, H, seed=1), SPLITS, _probs())


def test_sizes_not_multiples_of_128_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^hidden_size is 100, expected a multiple of 128 for"):
        GroupedMLP(E, 100, FFN, **FP8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^ffn_hidden_size is 64, expected a multiple of 128"):
        GroupedMLP(E, H, 64, **FP8)  # type: ignore[arg-type]  (2F = 128 would pass fc1)
    GroupedMLP(E, 100, 64)  # the bf16 path takes any size
    x, w1, w2 = _randn(T, 100, seed=1), _randn(E, 128, 100, seed=2), _randn(E, 100, 64, seed=3)
    with pytest.raises(ValueError, match=r"^hidden size \(x's columns\) is 100, expected"):
        grouped_mlp(x, w1, w2, SPLITS, **FP8)  # type: ignore[arg-type]
    x, w1, w2 = _randn(T, H, seed=1), _randn(E, 128, H, seed=2), _randn(E, H, 64, seed=3)
    with pytest.raises(ValueError, match=r"^ffn size \(fc2_weights' last dimension\) is 64, exp"):
        grouped_mlp(x, w1, w2, SPLITS, **FP8)  # type: ignore[arg-type]


def test_bad_splits_and_flags_are_named() -> None:
    mlp, x = _mlp(), _randn(T, H, seed=1)
    with pytest.raises(ValueError, match=r"^fp8_recipe='blockwise' quantizes x: splits sums to 10"):
        mlp(x, [1, 2, 3, 4])
    with pytest.raises(TypeError, match=r"^is_first_microbatch is 1, expected None, True or"):
        mlp(x, SPLITS, is_first_microbatch=1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the weight caches


@pytest.mark.parametrize("layer", ["fc1", "fc2"])
def test_the_flag_is_the_rule_for_a_data_write_the_guard_cannot_see(layer: str) -> None:
    """``p.data.copy_(...)`` keeps pointer and version: ``False`` reuses the stale cache."""
    mlp, x = _mlp(), _randn(T, H, seed=1)
    cached = _y(mlp, x, True)
    weight = getattr(mlp, layer).weight2  # an expert with tokens
    weight.data.copy_(_randn(*weight.shape, seed=3))
    fresh = _y(mlp, x, None)  # None never reads the cache
    assert not torch.equal(fresh, cached)
    assert torch.equal(_y(mlp, x, False), cached)  # documented: only the flag catches this
    assert torch.equal(_y(mlp, x, True), fresh)  # True quantizes both layers anew and caches
    assert torch.equal(_y(mlp, x, False), fresh)


@pytest.mark.parametrize("layer", ["fc1", "fc2"])
@pytest.mark.parametrize("edit", ["in_place", "optimizer_step", "new_parameter"])
def test_the_caches_drop_weights_they_see_changed(edit: str, layer: str) -> None:
    mlp, x = _mlp(), _randn(T, H, seed=1)
    before = _y(mlp, x, True)
    linear = getattr(mlp, layer)
    if edit == "in_place":  # moves the version counter
        with torch.no_grad():
            linear.weight2.mul_(-1.5)
    elif edit == "optimizer_step":  # torch.optim updates in place under no_grad
        for p in linear.parameters():
            p.grad = _randn(*p.shape, seed=4)
        torch.optim.SGD(linear.parameters(), lr=1.0).step()
    else:  # another parameter object
        linear.weight2 = nn.Parameter(-1.5 * linear.weight2.detach())
    after = _y(mlp, x, False)
    assert not torch.equal(after, before)
    assert torch.equal(after, _y(mlp, x, None))


def test_cached_weights_serve_both_dgrads() -> None:
    """``False`` after a hidden write: forward and both dgrads use the weights cached at ``True``."""
    mlp, x0, dy, probs = _mlp(), _randn(T, H, seed=1), _randn(T, H, seed=5), _probs()
    before = copy.deepcopy(mlp)
    mlp(x0, SPLITS, probs, is_first_microbatch=True)
    for layer in (mlp.fc1, mlp.fc2):
        layer.weight2.data.copy_(_randn(*layer.weight2.shape, seed=3))
    grads = []
    for module, flag in ((mlp, False), (before, None)):
        x = x0.clone().requires_grad_()
        module(x, SPLITS, probs, is_first_microbatch=flag).backward(dy)
        grads.append(x.grad)
    assert torch.equal(*grads)


def test_distributed_weights_are_never_cached() -> None:
    mlp, x = _mlp(), _randn(T, H, seed=1)
    groups = {}
    for name in ("fc1", "fc2"):
        layer = getattr(mlp, name)
        groups[name] = make_fake_group([getattr(layer, n) for n in layer.weight_names])
        for weight_name, member in zip(layer.weight_names, groups[name], strict=True):
            setattr(layer, weight_name, member)
    _y(mlp, x, True)
    for group in groups.values():
        group[2].data.copy_(_randn(*group[2].shape, seed=3))  # invisible to a cache
    assert torch.equal(_y(mlp, x, False), _y(mlp, x, None))


# --------------------------------------------------------------------------- what backward keeps


def _saved_bytes(mlp: GroupedMLP, x: Tensor, splits: list[int], probs: Tensor) -> int:
    """Bytes of every storage the forward saves for backward (each storage counted once)."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x, splits, probs)
    return sum(storages.values())


@pytest.mark.parametrize(("hidden", "ffn"), [(128, 128), (256, 128), (128, 384)])
def test_backward_keeps_at_most_six_tenths_of_the_bf16_bytes_per_token(
    hidden: int, ffn: int
) -> None:
    """FP8 keeps x's (128, 1) and h's (1, 128) forms: 1.03·(H + 2F) bytes, not 2·(H + 2F)."""
    splits = [300, 0, 500, 224]
    tokens = sum(splits)
    x = _randn(tokens, hidden, seed=1).requires_grad_()
    probs = torch.rand(tokens, requires_grad=True)
    sizes = (E, hidden, ffn)
    bf16 = _saved_bytes(GroupedMLP(*sizes, dtype=BF16), x, splits, probs) / tokens
    fp8 = _saved_bytes(GroupedMLP(*sizes, dtype=BF16, **FP8), x, splits, probs) / tokens  # type: ignore[arg-type]
    assert bf16 == 2 * (hidden + 2 * ffn) + 4  # x, h and fp32 probs
    assert fp8 <= 0.6 * bf16, (fp8, bf16)


def test_the_deferred_wgrads_are_served_from_the_saved_fp8_forms() -> None:
    """x changed in place after forward and after backward: FP8 kept its own forms (bf16 raises)."""
    x0, dy, probs = _randn(T, H, seed=1), _randn(T, H, seed=5), _probs()
    now = _mlp()
    now(x0.clone().requires_grad_(), SPLITS, probs).backward(dy)
    for recipe in (None, "blockwise"):
        mlp = _mlp(delay_wgrad_compute=True, fp8_recipe=recipe)
        x = x0.clone().requires_grad_()
        y = mlp(x, SPLITS, probs)
        with torch.no_grad():
            x.mul_(2.0)
        if recipe is None:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward(dy)
            continue
        y.backward(dy)
        with torch.no_grad():
            x.mul_(2.0)
        assert mlp.fc1.weight0.grad is None  # nothing before backward_dw()
        mlp.backward_dw()
        for (name, got), want in zip(mlp.named_parameters(), now.parameters(), strict=True):
            assert torch.equal(got.grad, want.grad), name


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_four_micro_batches_accumulate_in_fp32_main_grad(dtype: torch.dtype) -> None:
    """main_grad = fp64 sum of the dequantized-operand products, within 2x one GEMM's tolerance."""
    mlp = _mlp(dtype=dtype, single_grouped_weight=True, accumulate_into_main_grad=True)
    layers = (mlp.fc1, mlp.fc2)
    for p in (mlp.fc1.weight, mlp.fc2.weight):
        p.main_grad = torch.zeros(p.shape)  # type: ignore[attr-defined]
        p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    want = [torch.zeros(p.weight.shape, dtype=torch.float64) for p in layers]
    for step, splits in enumerate([SPLITS, [0, 90, 90, 20], [200, 0, 0, 0], [50, 50, 50, 50]]):
        x, dy = _randn(200, H, seed=10 + step, dtype=dtype), _randn(200, H, seed=20 + step)
        probs = torch.rand(200, generator=torch.Generator().manual_seed(30 + step))
        mlp(x, splits, probs, is_first_microbatch=step == 0).backward(dy.to(dtype))
        w1, w2 = (layer.weight.detach() for layer in layers)
        for index, dw in enumerate(fp8_mlp_wgrads(w1, w2, x, probs, dy.to(dtype), splits)):
            want[index] += dw
    for layer, expected in zip(layers, want, strict=True):
        got = layer.weight.main_grad  # type: ignore[attr-defined]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=2e-4)
        assert bf16_exact_share(got) < 0.01


def test_the_forward_keeps_its_quantized_weights_for_dgrad() -> None:
    """fc1 and fc2 quantized once per step, the same bits as quantizing again for dgrad."""
    mlp = _mlp()
    grads, counts = [], []
    for hooks in (False, True):
        x = _randn(T, H, seed=1).requires_grad_()

        def step(x: Tensor = x, hooks: bool = hooks) -> None:
            if hooks:  # saved-tensor hooks (checkpointing, offloading): dgrad quantizes again
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    y = mlp(x, SPLITS, _probs())
            else:
                y = mlp(x, SPLITS, _probs())
            y.backward(_randn(T, H, seed=5))

        counts.append(weight_quantizations(step))
        grads.append((x.grad, *(p.grad for p in mlp.parameters())))
        mlp.zero_grad()
    assert counts == [2, 4]
    for kept, again in zip(*grads, strict=True):
        assert torch.equal(kept, again)


def test_activation_recompute_requantizes_identically() -> None:
    """Under ``torch.utils.checkpoint`` the recomputed forward quantizes as the first did."""
    x0, dy, probs0 = _randn(T, H, seed=1), _randn(T, H, seed=5), _probs()
    grads = []
    for recompute in (False, True):
        mlp = _mlp(bias=True)
        x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        if recompute:
            y = torch.utils.checkpoint.checkpoint(mlp, x, SPLITS, probs, use_reentrant=False)
        else:
            y = mlp(x, SPLITS, probs)
        y.backward(dy)
        grads.append([x.grad, probs.grad, *(p.grad for p in mlp.parameters())])
    for plain, recomputed in zip(*grads, strict=True):
        assert torch.equal(plain, recomputed)


# --------------------------------------------------------------------------- dtypes, functional


def test_autocast_quantizes_from_the_autocast_dtype() -> None:
    """fp32 parameters under bf16 autocast run as bf16 parameters with fp32 grad_dtype do."""
    x, dy, probs = _randn(T, H, seed=1, dtype=torch.float32), _randn(T, H, seed=5), _probs()
    mlp = _mlp(dtype=torch.float32, single_grouped_weight=True)
    twin = _mlp(dtype=BF16, single_grouped_weight=True)
    with torch.no_grad():
        for mine, theirs in zip(mlp.parameters(), twin.parameters(), strict=True):
            theirs.copy_(mine)
            theirs.grad_dtype = torch.float32
    with torch.autocast("cpu", dtype=BF16):
        y = mlp(x, SPLITS, probs)
    assert y.dtype == BF16
    y_twin = twin(x.to(BF16), SPLITS, probs)
    assert torch.equal(y, y_twin)
    y.backward(dy)
    y_twin.backward(dy)
    for mine, theirs in zip(mlp.parameters(), twin.parameters(), strict=True):
        assert mine.grad is not None
        assert mine.grad.dtype == torch.float32
        assert torch.equal(mine.grad, theirs.grad)
    w1, w2 = mlp.fc1.weight.detach().to(BF16), mlp.fc2.weight.detach().to(BF16)
    ref = mlp_reference(w1, w2, ([None] * E, [None] * E), x.to(BF16), probs, dy, SPLITS,
                        fp8=True, dtype=BF16)  # fmt: skip
    error = (y.double() - ref["y"]).norm() / ref["y"].norm()
    assert error < 1e-2, error  # bf16 roundings of the chain only


def test_functional_op_with_per_expert_weights_biases_and_fp32_grad_dtype() -> None:
    w1 = [nn.Parameter(_randn(2 * FFN, H, seed=30 + e)) for e in range(E)]
    w2 = [nn.Parameter(_randn(H, FFN, seed=40 + e)) for e in range(E)]
    b1 = [nn.Parameter(_randn(2 * FFN, seed=50 + e)) for e in range(E)]
    b2 = [nn.Parameter(_randn(H, seed=60 + e)) for e in range(E)]
    for p in (*w1, *w2, *b1, *b2):
        p.grad_dtype = torch.float32
    x, dy = _randn(T, H, seed=1), _randn(T, H, seed=5)
    y = grouped_mlp(x, w1, w2, SPLITS, _probs(), fc1_bias=b1, fc2_bias=b2, **FP8)  # type: ignore[arg-type]
    assert y.dtype == BF16
    y.backward(dy)
    for p in (*w1, *w2, *b1, *b2):
        assert p.grad is not None
        assert p.grad.dtype == torch.float32
    for e, rows in enumerate(dy.double().split(SPLITS)):  # fc2's bias sums the unquantized dy
        torch.testing.assert_close(b2[e].grad.double(), rows.sum(0), rtol=1e-6, atol=1e-5)


def test_checkpoints_and_copies_carry_no_fp8_state() -> None:
    mlp, x = _mlp(bias=True), _randn(T, H, seed=1)
    _y(mlp, x, True)
    state = mlp.state_dict()
    assert list(state) == list(_mlp(bias=True, fp8_recipe=None).state_dict())
    assert all(t.dtype == BF16 for t in state.values())
    assert "fp8_recipe='blockwise'" in repr(mlp)
    copied = pickle.loads(pickle.dumps(mlp))
    copied.fc2.weight2.data.copy_(_randn(H, FFN, seed=3))  # a travelled cache would hide this
    assert torch.equal(_y(copied, x, False), _y(copied, x, None))


# --------------------------------------------------------------------------- torch.compile


class _Experts(nn.Module):
    """FP8 MLPs on the fp32 wgrad routes: grad_dtype, main_grad accumulate, delayed wgrad."""

    def __init__(self) -> None:
        super().__init__()
        self.gd = _mlp(bias=True)
        self.acc = _mlp(single_grouped_weight=True, accumulate_into_main_grad=True)
        self.delay = _mlp(delay_wgrad_compute=True)
        for p in (*self.gd.parameters(), *self.delay.parameters()):
            p.grad_dtype = torch.float32
        for p in self.acc.parameters():
            p.main_grad = torch.zeros(p.shape)
            p.grad_added_to_main_grad = False

    def forward(self, x: Tensor, splits: Tensor, probs: Tensor) -> Tensor:
        return self.delay(self.acc(self.gd(x, splits, probs), splits), splits, probs)

    def fp32_grads(self) -> dict[str, Tensor]:
        return {
            n: p.main_grad if n.startswith("acc.") else p.grad for n, p in self.named_parameters()
        }


def test_compiled_fp8_mlps_deliver_the_eager_fp32_wgrads() -> None:
    eager, compiled = _Experts(), _Experts()
    torch._dynamo.reset()
    step = torch.compile(compiled, fullgraph=True)
    for model, forward in ((eager, eager), (compiled, step)):
        for micro_batch in range(2):
            splits = torch.tensor([[90, 0, 60, 50], [10, 100, 0, 90]][micro_batch])
            x = _randn(200, H, seed=50 + micro_batch).requires_grad_()
            probs = torch.rand(200, generator=torch.Generator().manual_seed(micro_batch))
            y = forward(x, splits, probs.requires_grad_())
            y.backward(_randn(200, H, seed=60 + micro_batch))
            model.delay.backward_dw()
    want = eager.fp32_grads()
    for name, got in compiled.fp32_grads().items():
        assert got.dtype == torch.float32, name
        assert torch.equal(got, want[name]), name
        assert_keeps_fp32(got, want[name], name)


@pytest.mark.parametrize("case", ["no_grad", "frozen_fc1"])
def test_x_is_quantized_for_fc1s_wgrad_only_where_it_runs(case: str) -> None:
    # Catches: the forward writing x's (128, 1) form where fc1's wgrad will not read it (an
    # evaluation step; fc1 frozen): the outputs and fc2's wgrad must not change.
    mlp, x = _mlp(), _randn(T, H, seed=1).requires_grad_()
    out: dict[str, Tensor] = {}

    def forward() -> None:
        out["y"] = mlp(x, SPLITS)

    assert token_quantizations(forward) == 1  # the premise: a training forward writes x's
    want = out["y"]
    want.float().square().sum().backward()
    want_dx, x.grad = x.grad, None
    want_fc2 = [p.grad.clone() for p in mlp.fc2.parameters()]
    mlp.zero_grad()
    if case == "no_grad":
        with torch.no_grad():
            assert token_quantizations(forward) == 0
    else:
        mlp.fc1.requires_grad_(False)
        assert token_quantizations(forward) == 0
        out["y"].float().square().sum().backward()
        assert torch.equal(x.grad, want_dx)
        for p, w in zip(mlp.fc2.parameters(), want_fc2, strict=True):
            assert torch.equal(p.grad, w)
    assert torch.equal(out["y"], want)
