"""``fp8_recipe="blockwise"`` on ``GroupedLinear`` and ``grouped_linear`` beyond the matrix.

The matrix (``test_linear_matrix.py``) runs every combination of DESIGN's
options in FP8 against an fp64 product of the dequantized operands. Here: the
recipe and size errors, the weight cache (``is_first_microbatch``), what
backward keeps (bytes per token, the deferred wgrad served from the saved FP8
forms), four micro-batches into fp32 ``main_grad``, autocast, the functional
op, checkpoints, and ``torch.compile`` delivering the eager fp32 wgrads.
Everything runs the kernels' reference on the CPU.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import Tensor, nn

from groupgrad.kernels import Fp8Blocks, quantize_fp8
from groupgrad.modules import GroupedLinear, GroupedMLP, grouped_linear
from groupgrad.modules._fp8_recipe import keeps_weights_for_backward
from groupgrad.protocol.testing import make_fake_group
from groupgrad_testsupport.calls import token_quantizations, weight_quantizations
from groupgrad_testsupport.compiled import assert_keeps_fp32, bf16_exact_share

E, K, N = 4, 256, 128
SPLITS = [140, 0, 37, 23]  # an expert of two token blocks, an empty one
T = sum(SPLITS)
ROWS, WEIGHTS, TOKENS = (1, 128), (128, 128), (128, 1)
BF16 = torch.bfloat16
FP8 = {"fp8_recipe": "blockwise"}


def _randn(*shape: int, seed: int, dtype: torch.dtype = BF16) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _layer(**options: object) -> GroupedLinear:
    torch.manual_seed(0)
    return GroupedLinear(E, K, N, **{"dtype": BF16, **FP8, **options})  # type: ignore[arg-type]


def _deq(blocks: object) -> Tensor:
    assert isinstance(blocks, Fp8Blocks)
    return torch.as_tensor(blocks.dequantize()).double()


def _expected_y(x: Tensor, w_ENK: Tensor, splits: list[int]) -> Tensor:
    """fp64 ``x_e @ w_e.T`` of the dequantized ``(1, 128)`` x and ``(128, 128)`` weights."""
    x64, w64 = _deq(quantize_fp8(x, block=ROWS)), _deq(quantize_fp8(w_ENK, block=WEIGHTS))
    return torch.cat([x_e @ w64[e].T for e, x_e in enumerate(x64.split(splits))])


def _expected_wgrad(dy: Tensor, x: Tensor, splits: list[int]) -> Tensor:
    """fp64 ``dy_e.T @ x_e`` of the dequantized ``(128, 1)`` forms, ``(E, N, K)``."""
    dy64 = _deq(quantize_fp8(dy, block=TOKENS, splits=splits))
    x64 = _deq(quantize_fp8(x, block=TOKENS, splits=splits))
    return torch.stack(
        [d.T @ x_e for d, x_e in zip(dy64.split(splits), x64.split(splits), strict=True)]
    )


def _assert_bf16_close(got: Tensor, want: Tensor) -> None:
    """A bf16 GEMM output against its fp64 reference: one bf16 rounding of the largest value."""
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=2**-8 * want.abs().max())


def _weights(layer: GroupedLinear) -> Tensor:
    return torch.stack([getattr(layer, n).detach() for n in layer.weight_names]).reshape(E, N, K)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("recipe", ["tensorwise", "Blockwise", True, 8])
def test_an_unknown_recipe_names_the_supported_ones(recipe: object) -> None:
    message = rf"^fp8_recipe is {recipe!r}, expected None or one of: 'blockwise'$"
    with pytest.raises(ValueError, match=message):
        GroupedLinear(E, K, N, fp8_recipe=recipe)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        grouped_linear(_randn(T, K, seed=1), _randn(E, N, K, seed=2), SPLITS, fp8_recipe=recipe)  # type: ignore[arg-type]
    layer = GroupedLinear(E, K, N)  # the attribute set after construction: its forward says so
    layer.fp8_recipe = recipe  # type: ignore[assignment]
    with pytest.raises(ValueError, match=message):
        layer(_randn(T, K, seed=1), SPLITS)


def test_sizes_not_multiples_of_128_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^in_features is 100, expected a multiple of 128 for"):
        GroupedLinear(E, 100, N, **FP8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^out_features is 64, expected a multiple of 128 for"):
        GroupedLinear(E, K, 64, **FP8)  # type: ignore[arg-type]
    GroupedLinear(E, 100, 64)  # the bf16 path takes any size
    with pytest.raises(ValueError, match=r"^in_features \(x's columns\) is 100, expected"):
        grouped_linear(_randn(T, 100, seed=1), _randn(E, N, 100, seed=2), SPLITS, **FP8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^out_features \(the weights' rows\) is 64, expected"):
        grouped_linear(_randn(T, K, seed=1), _randn(E, 64, K, seed=2), SPLITS, **FP8)  # type: ignore[arg-type]


def test_a_mismatched_weight_is_named_by_its_parameter() -> None:
    # Catches: the quantizer's own name for a list member (t[2]) in the message.
    layer = _layer(bias=False)
    layer.weight2 = nn.Parameter(_randn(N, K, seed=3).float())
    with pytest.raises(
        TypeError,
        match=r"^fp8_recipe='blockwise' quantizes the weights: weight2 has dtype torch.float32, "
        r"expected torch.bfloat16 like weight0$",
    ):
        layer(_randn(T, K, seed=1), SPLITS)


def test_bad_splits_and_flags_are_named() -> None:
    layer = _layer()
    x = _randn(T, K, seed=1)
    with pytest.raises(
        ValueError, match=r"^fp8_recipe='blockwise' quantizes x: splits sums to 10 but x has 200"
    ):
        layer(x, [1, 2, 3, 4])
    with pytest.raises(TypeError, match=r"^is_first_microbatch is 1, expected None, True or"):
        layer(x, SPLITS, is_first_microbatch=1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the weight cache


def _y(layer: GroupedLinear, x: Tensor, flag: bool | None) -> Tensor:
    with torch.no_grad():
        return layer(x, SPLITS, is_first_microbatch=flag)


def test_the_flag_is_the_rule_for_a_data_write_the_guard_cannot_see() -> None:
    """``p.data.copy_(...)`` keeps pointer and version: ``False`` reuses the stale cache."""
    layer, x = _layer(bias=False), _randn(T, K, seed=1)
    cached = _y(layer, x, True)
    _assert_bf16_close(cached, _expected_y(x, _weights(layer), SPLITS))
    layer.weight2.data.copy_(_randn(N, K, seed=3))  # an expert with tokens
    fresh = _y(layer, x, None)  # None never reads the cache
    assert not torch.equal(fresh, cached)
    _assert_bf16_close(fresh, _expected_y(x, _weights(layer), SPLITS))
    assert torch.equal(_y(layer, x, False), cached)  # documented: only the flag catches this
    assert torch.equal(_y(layer, x, True), fresh)  # True quantizes anew and caches
    assert torch.equal(_y(layer, x, False), fresh)


@pytest.mark.parametrize(
    "edit", ["in_place", "optimizer_step", "fused_step", "data_assigned", "new_parameter"]
)
def test_the_cache_drops_weights_it_sees_changed(edit: str) -> None:
    layer, x = _layer(bias=False), _randn(T, K, seed=1)
    before = _y(layer, x, True)
    old = layer.weight2.data  # kept alive: a new tensor cannot reuse its address
    if edit == "in_place":  # moves the version counter
        with torch.no_grad():
            layer.weight2.mul_(-1.5)
    elif edit == "optimizer_step":  # torch.optim updates in place under no_grad
        for p in layer.parameters():
            p.grad = _randn(N, K, seed=4)
        torch.optim.SGD(layer.parameters(), lr=1.0).step()
    elif edit == "fused_step":  # a fused kernel moves neither version nor pointer
        for p in layer.parameters():
            p.grad = _randn(N, K, seed=4)
        torch.optim.Adam(layer.parameters(), lr=1.0, fused=True).step()
    elif edit == "data_assigned":  # another data pointer
        layer.weight2.data = -1.5 * old
    else:  # another parameter object
        layer.weight2 = nn.Parameter(-1.5 * old)
    after = _y(layer, x, False)
    assert not torch.equal(after, before)
    assert torch.equal(after, _y(layer, x, None))


def test_the_cache_sees_a_square_weight_transposed_in_place() -> None:
    # Catches: stamps without strides. `w.data = w.data.t()` on a square weight keeps its
    # parameter, data pointer, version and shape; only the strides say its values moved.
    torch.manual_seed(0)
    layer = GroupedLinear(E, K, K, dtype=BF16, bias=False, **FP8)  # type: ignore[arg-type]
    x = _randn(T, K, seed=1)
    before = _y(layer, x, True)
    for name in layer.weight_names:
        weight = getattr(layer, name)
        weight.data = weight.data.t()
    after = _y(layer, x, False)
    assert not torch.equal(after, before)
    assert torch.equal(after, _y(layer, x, None))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_fsdp_managed_layers_never_cache_their_weights(kind: str) -> None:
    """DESIGN: FSDP weights are never cached across forwards (FSDP gathers them at every
    forward); a cache would keep an FP8 copy of the gathered weights past the reshard.
    ``fully_shard`` marks what it manages ``_is_fsdp_managed_module`` (the integration's
    tests run the real one)."""
    torch.manual_seed(0)
    layer = _layer(bias=False) if kind == "linear" else GroupedMLP(E, K, 128, dtype=BF16, **FP8)  # type: ignore[arg-type]
    for module in layer.modules():
        module._is_fsdp_managed_module = True
    x = _randn(T, K, seed=1).requires_grad_()
    linears = [m for m in layer.modules() if isinstance(m, GroupedLinear)]

    def step(flag: bool) -> None:
        y = layer(x, SPLITS, is_first_microbatch=flag)
        if flag:
            y.sum().backward()

    # forward and dgrad each quantize every layer's weights; nothing is held past the step
    assert weight_quantizations(lambda: step(True)) == 2 * len(linears)
    assert not any(m._fp8_weights for m in linears)
    with torch.no_grad():
        assert weight_quantizations(lambda: step(False)) == len(linears)


def test_the_cache_keeps_the_addresses_it_recorded_taken() -> None:
    # Catches: a cache that lets a weight's memory go. Two `.data =` assignments can then put
    # the weight back at the address the cache recorded (the allocator reuses the freed
    # block), moving no version counter: False would serve the old weights' FP8 form.
    from torch.multiprocessing.reductions import StorageWeakRef

    layer, x = _layer(bias=False), _randn(T, K, seed=1)
    _y(layer, x, True)
    weight = layer.weight2
    quantized_from = StorageWeakRef(weight.untyped_storage())
    weight.data = -1.5 * weight.data
    weight.data = 0.5 * weight.data
    assert not quantized_from.expired()  # its address cannot come back while the entry lives
    assert torch.equal(_y(layer, x, False), _y(layer, x, None))
    _y(layer, x, True)  # a new entry lets the old memory go
    assert quantized_from.expired()


def test_a_cached_layer_converts_with_swapped_tensors() -> None:
    """The cache holds no weak reference: ``torch.utils.swap_tensors`` (``module.to()`` with
    torch's swap-on-conversion) takes the cached parameters, and the cache sees them changed."""
    layer, x = _layer(bias=False), _randn(T, K, seed=1)
    _y(layer, x, True)
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        layer.to(torch.float32)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    assert layer.weight2.dtype == torch.float32
    x32 = x.float()
    assert torch.equal(_y(layer, x32, False), _y(layer, x32, None))


def test_a_cached_weight_serves_dgrad_and_none_caches_nothing() -> None:
    layer, x = _layer(bias=False), _randn(T, K, seed=1).requires_grad_()
    dy = _randn(T, N, seed=5)
    w_before = _weights(layer).clone()
    layer(x, SPLITS, is_first_microbatch=True)
    layer.weight2.data.copy_(_randn(N, K, seed=3))  # invisible to the guard
    layer(x, SPLITS, is_first_microbatch=False).backward(dy)
    dy64, w64 = _deq(quantize_fp8(dy, block=ROWS)), _deq(quantize_fp8(w_before, block=WEIGHTS))
    want = torch.cat([d @ w64[e] for e, d in enumerate(dy64.split(SPLITS))])
    _assert_bf16_close(x.grad, want)


def test_distributed_weights_are_never_cached() -> None:
    layer, x = _layer(bias=False), _randn(T, K, seed=1)
    group = make_fake_group([getattr(layer, n) for n in layer.weight_names])
    for name, member in zip(layer.weight_names, group, strict=True):
        setattr(layer, name, member)
    _y(layer, x, True)
    group[2].data.copy_(_randn(N, K, seed=3))  # invisible to a cache: none must be used
    scaled = 2.0 * torch.stack([m.detach() for m in group])  # the fake's forward materialization
    _assert_bf16_close(_y(layer, x, False), _expected_y(x, scaled, SPLITS))


def test_megatron_fsdp_weights_are_never_cached() -> None:
    """Megatron-FSDP (ZeRO-1) writes updated weights into the same storage, no version moved."""
    layer, x = _layer(bias=False), _randn(T, K, seed=1)
    for name in layer.weight_names:
        getattr(layer, name).__fsdp_param__ = True
    cached = _y(layer, x, True)
    layer.weight2.data.copy_(_randn(N, K, seed=3))  # invisible to the cache's checks
    fresh = _y(layer, x, False)
    assert not torch.equal(fresh, cached)
    _assert_bf16_close(fresh, _expected_y(x, _weights(layer), SPLITS))


def _dgrad_and_quantizations(layer: nn.Module, *, hooks: bool) -> tuple[Tensor, int]:
    """``x.grad`` of one step and how many times the weights were quantized for it."""
    x, dy = _randn(T, K, seed=1).requires_grad_(), _randn(T, N, seed=5)

    def step() -> None:
        if hooks:  # saved-tensor hooks (checkpointing, offloading): nothing kept beyond them
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                y = layer(x, SPLITS)
        else:
            y = layer(x, SPLITS)
        y.backward(dy)

    count = weight_quantizations(step)
    return x.grad, count


def test_the_forward_keeps_its_quantized_weights_for_dgrad() -> None:
    """One weight quantization per step; under saved-tensor hooks dgrad quantizes again, same bits."""
    layer = _layer(bias=False)
    kept, once = _dgrad_and_quantizations(layer, hooks=False)
    again, twice = _dgrad_and_quantizations(layer, hooks=True)
    assert (once, twice) == (1, 2)
    assert torch.equal(kept, again)
    group = make_fake_group([getattr(layer, n) for n in layer.weight_names])
    for name, member in zip(layer.weight_names, group, strict=True):
        setattr(layer, name, member)
    assert _dgrad_and_quantizations(layer, hooks=False)[1] == 2  # gathered per use
    with torch.no_grad():  # no backward to keep anything for
        assert not keeps_weights_for_backward(layer)
    assert keeps_weights_for_backward(layer)


def test_a_weight_edited_in_place_before_backward_is_an_error() -> None:
    """The kept FP8 weights are what the forward saw; the weight itself changed, so backward
    refuses, as autograd does for a tensor it saved (it once quantized the edited weight again
    and gave the gradient of values the forward never saw)."""
    layer, dy = _layer(bias=False), _randn(T, N, seed=5)
    x = _randn(T, K, seed=1).requires_grad_()
    y = layer(x, SPLITS)
    with torch.no_grad():
        layer.weight2.mul_(-2.0)  # moves the version counter
    with pytest.raises(RuntimeError, match=r"^weight2 was modified in place after the forward"):
        y.backward(dy)


# --------------------------------------------------------------------------- what backward keeps


def _saved_bytes(layer: GroupedLinear, x: Tensor, splits: list[int]) -> int:
    """Bytes of every storage the forward saves for backward (each storage counted once)."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, splits)
    return sum(storages.values())


def test_backward_keeps_at_most_six_tenths_of_the_bf16_bytes_per_token() -> None:
    """FP8 keeps x's (128, 1) form: K bytes of data plus an fp32 scale per 128 tokens (≈ 0.52×)."""
    splits = [300, 0, 500, 224]
    x = _randn(sum(splits), K, seed=1).requires_grad_()
    bf16 = _saved_bytes(_layer(fp8_recipe=None), x, splits) / sum(splits)
    fp8 = _saved_bytes(_layer(), x, splits) / sum(splits)
    assert bf16 == 2 * K
    assert fp8 <= 0.6 * bf16, (fp8, bf16)


def test_the_deferred_wgrad_is_served_from_the_saved_fp8_forms() -> None:
    """x changed in place after forward and after backward: FP8 kept its own forms (bf16 raises)."""
    x0, dy = _randn(T, K, seed=1), _randn(T, N, seed=5)
    for recipe in (None, "blockwise"):
        layer = _layer(bias=False, delay_wgrad_compute=True, fp8_recipe=recipe)
        x = x0.clone().requires_grad_()
        y = layer(x, SPLITS)
        with torch.no_grad():
            x.mul_(2.0)
        if recipe is None:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward(dy)
            continue
        y.backward(dy)
        with torch.no_grad():
            x.mul_(2.0)
        assert layer.weight0.grad is None  # nothing before backward_dw()
        layer.backward_dw()
        want = _expected_wgrad(dy, x0, SPLITS)
        for e in range(E):
            w = getattr(layer, f"weight{e}")
            torch.testing.assert_close(w.grad.double(), want[e], rtol=2**-8, atol=1e-3)


def test_four_micro_batches_accumulate_in_fp32_main_grad() -> None:
    """main_grad = fp64 sum of the dequantized-operand products, within 2x one GEMM's tolerance."""
    layer = _layer(bias=False, single_grouped_weight=True, accumulate_into_main_grad=True)
    layer.weight.main_grad = torch.zeros(E, N, K)  # type: ignore[attr-defined]
    layer.weight.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    want = torch.zeros(E, N, K, dtype=torch.float64)
    for step, splits in enumerate([SPLITS, [0, 90, 90, 20], [200, 0, 0, 0], [50, 50, 50, 50]]):
        x, dy = _randn(200, K, seed=10 + step), _randn(200, N, seed=20 + step)
        layer(x, splits).backward(dy)
        want += _expected_wgrad(dy, x, splits)
    got = layer.weight.main_grad  # type: ignore[attr-defined]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-4)
    assert bf16_exact_share(got) < 0.01


# --------------------------------------------------------------------------- dtypes, functional


def test_autocast_quantizes_from_the_autocast_dtype() -> None:
    layer = _layer(bias=False, dtype=torch.float32, single_grouped_weight=True)
    x, dy = _randn(T, K, seed=1, dtype=torch.float32), _randn(T, N, seed=5)
    with torch.autocast("cpu", dtype=BF16):
        y = layer(x, SPLITS)
    assert y.dtype == BF16
    want = _expected_y(x.to(BF16), layer.weight.detach().to(BF16), SPLITS)
    _assert_bf16_close(y, want)
    y.backward(dy)
    assert layer.weight.grad is not None
    assert layer.weight.grad.dtype == torch.float32
    torch.testing.assert_close(
        layer.weight.grad.double(), _expected_wgrad(dy, x.to(BF16), SPLITS), rtol=1e-5, atol=1e-4
    )


def test_fp16_input_gives_fp16_output() -> None:
    layer = _layer(dtype=torch.float16)
    y = layer(_randn(T, K, seed=1, dtype=torch.float16), SPLITS)
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert layer.weight0.grad is not None
    assert layer.weight0.grad.dtype == torch.float16


def test_functional_op_with_per_expert_weights_and_fp32_grad_dtype() -> None:
    ws = [nn.Parameter(_randn(N, K, seed=30 + e)) for e in range(E)]
    bs = [nn.Parameter(_randn(N, seed=40 + e)) for e in range(E)]
    for p in (*ws, *bs):
        p.grad_dtype = torch.float32
    x, dy = _randn(T, K, seed=1), _randn(T, N, seed=5)
    y = grouped_linear(x, ws, SPLITS, bs, fp8_recipe="blockwise")
    w_ENK = torch.stack([w.detach() for w in ws])
    want = _expected_y(x, w_ENK, SPLITS) + torch.cat(
        [b.detach().double().expand(n, N) for b, n in zip(bs, SPLITS, strict=True)]
    )
    _assert_bf16_close(y, want)
    y.backward(dy)
    dw = _expected_wgrad(dy, x, SPLITS)
    for e, (w, b) in enumerate(zip(ws, bs, strict=True)):
        assert w.grad is not None
        assert w.grad.dtype == torch.float32
        torch.testing.assert_close(w.grad.double(), dw[e], rtol=1e-5, atol=1e-4)
        db = dy.double().split(SPLITS)[e].sum(0)  # the unquantized dy
        torch.testing.assert_close(b.grad.double(), db, rtol=1e-5, atol=1e-5)


def test_checkpoints_and_copies_carry_no_fp8_state() -> None:
    layer, x = _layer(), _randn(T, K, seed=1)
    _y(layer, x, True)
    state = layer.state_dict()
    assert list(state) == list(_layer(fp8_recipe=None).state_dict())
    assert all(t.dtype == BF16 for t in state.values())
    copy = pickle.loads(pickle.dumps(layer))
    copy.weight2.data.copy_(_randn(N, K, seed=3))  # a stale cache that travelled would hide this
    assert torch.equal(_y(copy, x, False), _y(copy, x, None))


# --------------------------------------------------------------------------- torch.compile


class _Chain(nn.Module):
    """FP8 layers on every fp32 wgrad route: main_grad accumulate/overwrite, grad_dtype, delay."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        lin = {"dtype": BF16, **FP8}
        self.acc = GroupedLinear(E, N, N, bias=False, accumulate_into_main_grad=True, **lin)  # type: ignore[arg-type]
        self.gd = GroupedLinear(E, N, N, single_grouped_weight=True, **lin)  # type: ignore[arg-type]
        self.ow = GroupedLinear(
            E, N, N, bias=False, single_grouped_weight=True, accumulate_into_main_grad=True, **lin
        )  # type: ignore[arg-type]
        self.delay = GroupedLinear(E, N, N, bias=False, delay_wgrad_compute=True, **lin)  # type: ignore[arg-type]
        for name in ("acc", "ow"):
            for p in getattr(self, name).parameters():
                p.main_grad = torch.zeros(p.shape)
                p.grad_added_to_main_grad = False
                p.overwrite_main_grad = name == "ow"
        for name in ("gd", "delay"):
            for p in getattr(self, name).parameters():
                p.grad_dtype = torch.float32

    def forward(self, x: Tensor, splits: Tensor | list[int]) -> Tensor:
        return self.delay(self.ow(self.gd(self.acc(x, splits), splits), splits), splits)

    def fp32_grads(self) -> dict[str, Tensor]:
        return {
            n: p.main_grad if n.split(".")[0] in ("acc", "ow") else p.grad
            for n, p in self.named_parameters()
        }


@pytest.mark.parametrize("splits_form", ["tensor", "list"])
def test_compiled_fp8_layers_deliver_the_eager_fp32_wgrads(splits_form: str) -> None:
    # Catches (list): the token-block quantizer reading a list's counts back from a tensor,
    # data-dependent under Dynamo (fullgraph failed inside Dynamo, naming nothing). A list is
    # specialised into the graph, and a recompile with fp32 .grad on bf16 weights is refused by
    # Dynamo (README): the list keeps its counts.
    eager, compiled = _Chain(), _Chain()
    torch._dynamo.reset()
    step = torch.compile(compiled, fullgraph=True)
    for model, forward in ((eager, eager), (compiled, step)):
        for micro_batch in range(2):
            counts = [[90, 0, 60, 50], [10, 100, 0, 90]][
                micro_batch if splits_form == "tensor" else 0
            ]
            splits = torch.tensor(counts) if splits_form == "tensor" else counts
            x = _randn(200, N, seed=50 + micro_batch).requires_grad_()
            forward(x, splits).backward(_randn(200, N, seed=60 + micro_batch))
            model.delay.backward_dw()
    want = eager.fp32_grads()
    for name, got in compiled.fp32_grads().items():
        assert got.dtype == torch.float32, name
        assert torch.equal(got, want[name]), name
        assert_keeps_fp32(got, want[name], name)
    for p in (*compiled.acc.parameters(), *compiled.ow.parameters()):
        assert p.grad_added_to_main_grad
        assert p.grad is not None
        assert not p.grad.any()


def test_the_weight_cache_is_refused_under_compile() -> None:
    layer, x = _layer(bias=False), _randn(T, K, seed=1)
    step = torch.compile(
        lambda x: layer(x, torch.tensor(SPLITS), is_first_microbatch=True),
        fullgraph=True,
        backend="aot_eager",
    )
    with pytest.raises(Exception, match="the FP8 weight cache is Python state"):
        step(x)


def test_activation_recompute_requantizes_identically() -> None:
    """Under ``torch.utils.checkpoint`` the recomputed forward quantizes x as the first did."""
    x0, dy = _randn(T, K, seed=1), _randn(T, N, seed=5)
    grads = []
    for recompute in (False, True):
        layer = _layer()
        x = x0.clone().requires_grad_()
        if recompute:
            y = torch.utils.checkpoint.checkpoint(layer, x, SPLITS, use_reentrant=False)
        else:
            y = layer(x, SPLITS)
        y.backward(dy)
        grads.append([x.grad, *(p.grad for p in layer.parameters())])
    for plain, recomputed in zip(*grads, strict=True):
        assert torch.equal(plain, recomputed)


def test_frozen_weights_take_no_wgrad_and_trainable_biases_still_learn() -> None:
    layer, x, dy = _layer(), _randn(T, K, seed=1).requires_grad_(), _randn(T, N, seed=5)
    for name in layer.weight_names:
        getattr(layer, name).requires_grad_(False)
    layer(x, SPLITS).backward(dy)
    assert all(getattr(layer, n).grad is None for n in layer.weight_names)
    assert x.grad is not None
    for e, rows in enumerate(dy.double().split(SPLITS)):
        _assert_bf16_close(getattr(layer, f"bias{e}").grad, rows.sum(0))  # a bf16 bias


@pytest.mark.parametrize("case", ["no_grad", "frozen"])
def test_x_is_quantized_for_a_wgrad_only_where_one_runs(case: str) -> None:
    # Catches: the forward writing x's (128, 1) form, and backward keeping it, where no wgrad
    # will read it (an evaluation step; every weight frozen): the outputs must not change.
    layer, x, dy = _layer(bias=False), _randn(T, K, seed=1).requires_grad_(), _randn(T, N, seed=5)
    want: dict[str, Tensor] = {}

    def train() -> None:
        want["y"] = layer(x, SPLITS)
        want["y"].backward(dy)

    assert token_quantizations(train) == 2  # the premise: x's and dy's (128, 1) forms
    want_dx, x.grad = x.grad, None
    got: dict[str, Tensor] = {}

    def run() -> None:
        if case == "no_grad":
            with torch.no_grad():
                got["y"] = layer(x, SPLITS)
            return
        for name in layer.weight_names:
            getattr(layer, name).requires_grad_(False)
        got["y"] = layer(x, SPLITS)
        got["y"].backward(dy)

    assert token_quantizations(run) == 0
    assert torch.equal(got["y"], want["y"])
    if case == "frozen":
        assert torch.equal(x.grad, want_dx)
