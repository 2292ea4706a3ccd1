"""Bad inputs to the modules: a named error, and nothing written anywhere.

Each case builds a layer whose every weight, ``.grad`` and ``main_grad`` is
watched (``main_grad`` and ``.grad`` start as NaN sentinels where they
exist), breaks one thing, runs forward and backward, and checks the exception
type, that the message names the argument and its value, and that no watched
tensor changed. Errors found at backward (``main_grad`` problems) must leave
every ``main_grad`` of the op untouched, the fused MLP's other layer included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

from groupgrad.modules import GroupedLinear, GroupedMLP, grouped_linear, grouped_mlp

E, K, N, H, FFN = 4, 16, 8, 16, 8
SPLITS = [3, 0, 5, 4]
T = sum(SPLITS)


def _rand(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _with_main_grads(module: nn.Module, **flags: object) -> nn.Module:
    for name, p in module.named_parameters():
        if "weight" in name:
            p.main_grad = torch.full(p.shape, float("nan"))
            p.grad_added_to_main_grad = False
            for flag, value in flags.items():
                setattr(p, flag, value)
    return module


def _linear(**options: object) -> GroupedLinear:
    torch.manual_seed(0)
    return GroupedLinear(E, K, N, **options)  # type: ignore[arg-type]


def _mlp(**options: object) -> GroupedMLP:
    torch.manual_seed(0)
    return GroupedMLP(E, H, FFN, **options)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Bad:
    """One bad input: ``run(module)`` does forward (and backward) with the break."""

    id: str
    build: Callable[[], nn.Module]
    run: Callable[[nn.Module], object]
    error: type[Exception]
    match: str


def _backward_linear(x: Tensor, splits: object = SPLITS) -> Callable[[nn.Module], object]:
    return lambda m: m(x, splits).sum().backward()


def _backward_mlp(
    x: Tensor, splits: object = SPLITS, probs: object = None
) -> Callable[[nn.Module], object]:
    return lambda m: m(x, splits, probs).sum().backward()


def _break_main_grad(module: nn.Module, name: str, value: object) -> nn.Module:
    module.get_parameter(name).main_grad = value
    return module


def _set(module: nn.Module, name: str, attribute: str, value: object) -> nn.Module:
    setattr(module.get_parameter(name), attribute, value)
    return module


def _shared_storage(module: nn.Module) -> nn.Module:
    module.weight2.main_grad = module.weight1.main_grad
    return module


_X = _rand(T, K, seed=1)
_XH = _rand(T, H, seed=2)
_MG = {"accumulate_into_main_grad": True}

CASES = [
    # --- GroupedLinear forward inputs
    Bad("x-1d", _linear, lambda m: m(_X[0], SPLITS), ValueError, r"x has shape \(16,\), expected \(tokens, 16\)"),
    Bad("x-wrong-width", _linear, lambda m: m(_rand(T, 5), SPLITS), ValueError, r"x has shape \(12, 5\), expected \(tokens, 16\)"),
    Bad("x-not-a-tensor", _linear, lambda m: m([[1.0] * K], SPLITS), ValueError, r"x has shape list"),
    Bad("x-dtype-mismatch", _linear, lambda m: m(_X.half(), SPLITS), TypeError, r"weight0 has dtype torch\.float32, expected torch\.float16 like x"),
    Bad("x-float64", _linear, lambda m: m(_X.double(), SPLITS), TypeError, r"x has dtype torch\.float64, expected torch\.bfloat16, torch\.float16 or torch\.float32"),
    Bad("splits-sum", _linear, _backward_linear(_X, [3, 0, 5, 3]), ValueError, r"splits sums to 11 but x has 12 rows"),
    Bad("splits-negative", _linear, _backward_linear(_X, [4, -1, 5, 4]), ValueError, r"splits\[1\] is -1, expected a token count >= 0"),
    Bad("splits-too-few", _linear, _backward_linear(_X, [3, 5, 4]), ValueError, r"splits has 3 entries but weights has 4 experts"),
    Bad("splits-float-tensor", _linear, _backward_linear(_X, torch.tensor([3.0, 0, 5, 4])), TypeError, r"splits has dtype torch\.float32, expected torch\.int32 or torch\.int64"),
    Bad("splits-2d", _linear, _backward_linear(_X, torch.tensor([[3, 0], [5, 4]])), ValueError, r"splits must be 1-D \(E,\), got shape \(2, 2\)"),
    Bad("splits-bool-entry", _linear, _backward_linear(_X, [3, True, 4, 4]), TypeError, r"splits\[1\] must be an int, got bool"),
    Bad("splits-string", _linear, _backward_linear(_X, "3054"), TypeError, r"splits must be a sequence of ints or an integer tensor, got str"),
    # --- main_grad problems, found at backward, nothing written
    Bad("main-grad-missing", lambda: _break_main_grad(_with_main_grads(_linear(bias=False, **_MG)), "weight2", None), _backward_linear(_X), RuntimeError, r"parameter 'weight2' has no main_grad"),
    Bad("main-grad-shape", lambda: _break_main_grad(_with_main_grads(_linear(**_MG)), "weight1", torch.zeros(K, N)), _backward_linear(_X), ValueError, r"weight1\.main_grad has shape \(16, 8\), expected \(N, K\) = \(8, 16\)"),
    Bad("main-grad-int", lambda: _break_main_grad(_with_main_grads(_linear(**_MG)), "weight0", torch.zeros(N, K, dtype=torch.int32)), _backward_linear(_X), RuntimeError, r"main_grad of 'weight0' has dtype torch\.int32"),
    Bad("main-grad-mixed-dtypes", lambda: _break_main_grad(_with_main_grads(_linear(**_MG)), "weight3", torch.zeros(N, K, dtype=torch.bfloat16)), _backward_linear(_X), TypeError, r"weight3\.main_grad has dtype torch\.bfloat16, expected torch\.float32 like weight0\.main_grad"),
    Bad("main-grad-transposed", lambda: _break_main_grad(_with_main_grads(_linear(**_MG)), "weight1", torch.zeros(K, N).t()), _backward_linear(_X), ValueError, r"weight1\.main_grad must be row-major \(stride 1 in the last dimension\), got shape \(8, 16\) with strides \(1, 8\)"),
    Bad("main-grad-shared", lambda: _shared_storage(_with_main_grads(_linear(**_MG))), _backward_linear(_X), ValueError, r"weight2\.main_grad overlaps weight1\.main_grad in memory"),
    Bad("main-grad-other-device", lambda: _break_main_grad(_with_main_grads(_linear(**_MG)), "weight2", torch.empty(N, K, device="meta")), _backward_linear(_X), ValueError, r"weight2\.main_grad is on meta, expected cpu like dy"),
    Bad("overwrite-differs", lambda: _set(_with_main_grads(_linear(**_MG), overwrite_main_grad=True), "weight3", "overwrite_main_grad", False), _backward_linear(_X), RuntimeError, r"overwrite_main_grad differs within one group .*weight3=False"),
    Bad("packed-main-grad-shape", lambda: _break_main_grad(_with_main_grads(_linear(single_grouped_weight=True, **_MG)), "weight", torch.zeros(E, K, N)), _backward_linear(_X), ValueError, r"weight\.main_grad has shape \(4, 16, 8\), expected \(E, N, K\) = \(4, 8, 16\)"),
    Bad("packed-main-grad-2d", lambda: _break_main_grad(_with_main_grads(_linear(single_grouped_weight=True, **_MG)), "weight", torch.zeros(N, K)), _backward_linear(_X), ValueError, r"weight\.main_grad has shape \(8, 16\), expected \(E, N, K\) = \(4, 8, 16\)"),
    Bad("backward-dw-nothing-queued", lambda: _linear(delay_wgrad_compute=True), lambda m: m.backward_dw(), RuntimeError, r"GroupedLinear\.backward_dw\(\) was called but no backward has queued"),
    # --- GroupedMLP
    Bad("mlp-x-wrong-width", _mlp, lambda m: m(_rand(T, 5), SPLITS), ValueError, r"x has shape \(12, 5\), expected \(tokens, 16\) for hidden_size=16"),
    Bad("mlp-probs-shape", _mlp, _backward_mlp(_XH, SPLITS, torch.rand(T, 1)), ValueError, r"probs has shape \(12, 1\), expected \(T,\) = \(12,\)"),
    Bad("mlp-probs-int", _mlp, _backward_mlp(_XH, SPLITS, torch.ones(T, dtype=torch.int64)), TypeError, r"probs has dtype torch\.int64, expected a floating-point dtype"),
    Bad("mlp-probs-list", _mlp, _backward_mlp(_XH, SPLITS, [0.5] * T), TypeError, r"probs is a list, expected a Tensor or None"),
    Bad("mlp-splits-sum", _mlp, _backward_mlp(_XH, [3, 0, 5, 5]), ValueError, r"splits sums to 13 but x has 12 rows"),
    Bad("mlp-fc1-main-grad-shape", lambda: _break_main_grad(_with_main_grads(_mlp(**_MG)), "fc1.weight2", torch.zeros(2 * FFN, H + 1)), _backward_mlp(_XH), ValueError, r"fc1\.weight2\.main_grad has shape \(16, 17\), expected \(N, K\) = \(16, 16\)"),
    Bad("mlp-fc1-main-grad-missing", lambda: _break_main_grad(_with_main_grads(_mlp(**_MG)), "fc1.weight0", None), _backward_mlp(_XH), RuntimeError, r"parameter 'fc1\.weight0' has no main_grad"),
    Bad("mlp-backward-dw-nothing-queued", lambda: _mlp(delay_wgrad_compute=True), lambda m: m.backward_dw(), RuntimeError, r"GroupedMLP\.backward_dw\(\) was called but no backward has queued"),
]  # fmt: skip


def _watched(module: nn.Module) -> dict[str, Tensor]:
    watched: dict[str, Tensor] = {}
    for name, p in module.named_parameters():
        watched[name] = p.detach().clone()
        main_grad = getattr(p, "main_grad", None)
        if isinstance(main_grad, Tensor) and main_grad.device.type != "meta":
            watched[f"{name}.main_grad"] = main_grad.clone()
    return watched


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_named_and_writes_nothing(case: Bad) -> None:
    module = case.build()
    before = _watched(module)
    with pytest.raises(case.error, match=case.match):
        case.run(module)
    after = _watched(module)
    assert before.keys() == after.keys()
    for name, old in before.items():
        assert torch.equal(old.isnan(), after[name].isnan()), f"{name} was written"
        assert torch.equal(old.nan_to_num(), after[name].nan_to_num()), f"{name} was written"
    for name, p in module.named_parameters():
        assert p.grad is None, f"{name}.grad was written"
        if hasattr(p, "grad_added_to_main_grad"):
            assert p.grad_added_to_main_grad is False, f"{name} was flagged"


def test_the_valid_version_of_each_module_case_runs() -> None:
    # control: the unbroken builds run forward and backward without error
    for build, run in (
        (lambda: _with_main_grads(_linear(**_MG)), _backward_linear(_X)),
        (lambda: _with_main_grads(_mlp(**_MG)), _backward_mlp(_XH)),
        (_mlp, _backward_mlp(_XH, SPLITS, torch.rand(T))),
    ):
        run(build())


# --- constructors and functional ops: rejected before anything exists to write


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: GroupedLinear(0, K, N), ValueError, r"num_groups is 0, expected a positive int"),
        (lambda: GroupedLinear(True, K, N), ValueError, r"num_groups is True, expected a positive int"),
        (lambda: GroupedLinear(E, 2.5, N), ValueError, r"in_features is 2\.5, expected a positive int"),
        (lambda: GroupedLinear(E, K, -1), ValueError, r"out_features is -1, expected a positive int"),
        (lambda: GroupedMLP(E, H, 0), ValueError, r"ffn_hidden_size is 0, expected a positive int"),
        (lambda: GroupedMLP(E, False, FFN), ValueError, r"hidden_size is False, expected a positive int"),
        (lambda: GroupedMLP(E, H, FFN, activation="gelu"), ValueError, r"activation is 'gelu'; GroupedMLP supports only 'swiglu'"),
    ],
)  # fmt: skip
def test_bad_constructor_arguments_are_named(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


def _params(*shape: int, seed: int) -> Tensor:
    return _rand(*shape, seed=seed).requires_grad_()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda w: grouped_linear(_X, [], SPLITS), ValueError, r"weights is empty; expected E >= 1"),
        (lambda w: grouped_linear(_X, [w[0], "w"], SPLITS), TypeError, r"weights\[1\] is a str, expected a Tensor"),
        (lambda w: grouped_linear(_X, w[2], SPLITS), ValueError, r"weights has shape \(8, 16\), expected \(E, N, K\)"),
        (lambda w: grouped_linear(_X, w[1], SPLITS, bias=[torch.zeros(N)] * E), ValueError, r"bias is a list; expected a packed \(E, N\) tensor with a packed"),
        (lambda w: grouped_linear(_X, list(w[1].unbind(0)), SPLITS, bias=[torch.zeros(N)] * 3), ValueError, r"bias has 3 entries, expected 4"),
        (lambda w: grouped_mlp(_XH, w[3], w[4], SPLITS, activation="relu"), ValueError, r"activation is 'relu'; grouped_mlp supports only 'swiglu'"),
        (lambda w: grouped_mlp(_XH, w[3], w[3], SPLITS), ValueError, r"fc1_weights has shape \(4, 16, 16\) and fc2_weights has shape \(4, 16, 16\); expected fc1 \(·, 2F, H\) and fc2 \(·, H, F\)"),
        (lambda w: grouped_mlp(_XH, w[3], list(w[4].unbind(0)), SPLITS), ValueError, r"fc1_weights and fc2_weights differ in layout"),
        (lambda w: grouped_mlp(_XH, w[3], w[4], SPLITS, fc1_bias=torch.zeros(E, 2 * FFN)), ValueError, r"fc1_bias and fc2_bias must be given both or neither"),
        (lambda w: grouped_mlp(_XH, w[3], w[4], SPLITS, torch.rand(T + 1)), ValueError, r"probs has shape \(13,\), expected \(T,\) = \(12,\)"),
        (lambda w: grouped_mlp(_XH, "fc1", w[4], SPLITS), TypeError, r"fc1_weights is str, expected an \(E, ·, ·\) tensor"),
        (lambda w: grouped_mlp(_XH.numpy(), w[3], w[4], SPLITS), TypeError, r"x is a ndarray, expected a Tensor"),
        # biases against their weights' outputs (an extra row was ignored, (E, 1) broadcast)
        (lambda w: grouped_mlp(_XH, w[3], w[4], SPLITS, fc1_bias=torch.zeros(E + 1, 2 * FFN), fc2_bias=torch.zeros(E, H)), ValueError, r"fc1_bias has shape \(5, 16\), expected \(E, N\) = \(4, 16\) like fc1_weights"),
        (lambda w: grouped_mlp(_XH, w[3], w[4], SPLITS, fc1_bias=torch.zeros(E, 2 * FFN), fc2_bias=torch.zeros(E, 1)), ValueError, r"fc2_bias has shape \(4, 1\), expected \(E, N\) = \(4, 16\) like fc2_weights"),
        (lambda w: grouped_mlp(_XH, w[3], w[4], SPLITS, fc1_bias=torch.zeros(E - 1, 2 * FFN), fc2_bias=torch.zeros(E, H)), ValueError, r"fc1_bias has shape \(3, 16\), expected \(E, N\) = \(4, 16\)"),
        (lambda w: grouped_mlp(_XH, list(w[3].unbind(0)), list(w[4].unbind(0)), SPLITS, fc1_bias=[torch.zeros(2 * FFN), torch.zeros(2 * FFN + 1), torch.zeros(2 * FFN), torch.zeros(2 * FFN)], fc2_bias=[torch.zeros(H)] * E), ValueError, r"fc1_bias\[1\] has shape \(17,\), expected \(N,\) = \(16,\) like fc1_weights\[1\]"),
        (lambda w: grouped_linear(_X, w[1], SPLITS, bias=torch.zeros(E, N + 1)), ValueError, r"bias has shape \(4, 9\), expected \(E, N\) = \(4, 8\) like weights"),
        (lambda w: grouped_linear(_X, w[1], SPLITS, bias=torch.zeros(E, N, device="meta")), ValueError, r"bias is on meta, expected cpu like weights"),
        # the kernels' messages name the caller's arguments, not their own
        (lambda w: grouped_mlp(_XH, [m.half() if e == 1 else m for e, m in enumerate(w[3].unbind(0))], list(w[4].unbind(0)), SPLITS), TypeError, r"fc1_weights\[1\] has dtype torch\.float16, expected torch\.float32 like fc1_weights\[0\]"),
        (lambda w: grouped_mlp(_XH, w[3], w[4].half(), SPLITS), TypeError, r"fc2_weights has dtype torch\.float16, expected torch\.float32 like x"),
    ],
)  # fmt: skip
def test_bad_functional_arguments_are_named_and_write_nothing(call, error, match) -> None:
    weights = [
        _params(E, N, K, seed=10),  # unused placeholder keeps indices readable
        _params(E, N, K, seed=11),
        _params(N, K, seed=12),
        _params(E, 2 * FFN, H, seed=13),
        _params(E, H, FFN, seed=14),
    ]
    before = [w.detach().clone() for w in weights]
    with pytest.raises(error, match=match):
        call(weights)
    for w, old in zip(weights, before, strict=True):
        assert torch.equal(w.detach(), old)
        assert w.grad is None


def test_splits_given_as_a_generator_is_read_once_for_every_gemm() -> None:
    # Catches: fc1 consuming the generator and fc2 reporting "splits has 0 entries".
    w1, w2 = _params(E, 2 * FFN, H, seed=15), _params(E, H, FFN, seed=16)
    want = grouped_mlp(_XH, w1, w2, SPLITS)
    got = grouped_mlp(_XH, w1, w2, (count for count in SPLITS))
    assert torch.equal(got, want)
