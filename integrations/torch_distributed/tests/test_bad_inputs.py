"""Bad and edge inputs of the torch_distributed API: a clear error that names the argument, and nothing written.

Each case builds its module, puts sentinels where a half-done call would
write (random weights, NaN ``main_grad`` shards, ``grad_added_to_main_grad``,
the set of parameter objects), makes the call and checks the exception type,
that its message names the argument and its value, and that every sentinel is
unchanged. None of these calls communicates, so the process pretends to be
rank 1 of 2 (``torch.distributed``'s rank queries patched); what needs a real
process group (DDP, checkpoints, frozen members in training) is tested with
gloo processes in ``test_training_loop.py``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from groupgrad.integrations.torch_distributed import (
    ExpertShardGroup,
    MasterWeights,
    ShardedExpertWeight,
    ddp_ignore_sharded,
    full_state_dict,
    gather_full_weights,
    load_full_state_dict,
    named_sharded_parameters,
    shard_expert_weights,
)
from groupgrad.modules import GroupedLinear, GroupedMLP

E, K, N = 3, 4, 6  # experts, in_features, out_features (rank 1 of 2 keeps rows 3..5)


@pytest.fixture(autouse=True)
def rank_1_of_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)


def _layer(**options: Any) -> GroupedLinear:
    return GroupedLinear(E, K, N, bias=options.pop("bias", False), **options)


def _sharded(**options: Any) -> GroupedLinear:
    """A sharded layer whose main_grad shards hold NaN sentinels."""
    layer = _layer(**options)
    shard_expert_weights(layer)
    for _, param in named_sharded_parameters(layer):
        param.main_grad.fill_(math.nan)  # type: ignore[attr-defined]
    return layer


@dataclass
class Snapshot:
    """Every parameter of a module: the object, its values, its main_grad and flag."""

    params: dict[str, tuple[Tensor, Tensor, Tensor | None, object]]

    @classmethod
    def of(cls, module: nn.Module) -> Snapshot:
        params = {}
        for name, param in module.named_parameters():
            main_grad = getattr(param, "main_grad", None)
            params[name] = (
                param,
                param.detach().clone(),
                None if main_grad is None else main_grad.clone(),
                getattr(param, "grad_added_to_main_grad", "absent"),
            )
        return cls(params)

    def assert_unchanged(self, module: nn.Module) -> None:
        now = dict(module.named_parameters())
        assert now.keys() == self.params.keys(), "parameters were added or removed"
        for name, (param, values, main_grad, flag) in self.params.items():
            assert now[name] is param, f"{name} was replaced"
            _same(param.detach(), values, f"{name}")
            if main_grad is not None:
                _same(param.main_grad, main_grad, f"{name}.main_grad")  # type: ignore[attr-defined]
            assert getattr(param, "grad_added_to_main_grad", "absent") == flag, f"{name} flag"
            assert param.grad is None, f"{name}.grad was written"


def _same(actual: Tensor, expected: Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=what)


@dataclass
class Case:
    """One bad input: build the module, make the call, expect this error."""

    name: str
    build: Callable[[], Any]
    call: Callable[[Any], object]
    error: type[Exception]
    match: str

    def __str__(self) -> str:
        return self.name


def _mlp_with_bad_fc2() -> GroupedMLP:
    return GroupedMLP(E, hidden_size=5, ffn_hidden_size=2)  # fc1 rows 4 split fine, fc2's 5 do not


def _tied() -> nn.Module:
    """Two layers whose expert weights are the same parameters (a tied pair)."""
    parent = nn.ModuleDict({"a": _layer(), "b": _layer()})
    for e in range(E):
        setattr(parent["b"], f"weight{e}", getattr(parent["a"], f"weight{e}"))
    return parent


def _tied_to_a_linear() -> nn.Module:
    """An expert weight that a plain linear holds too (an output head tied to it)."""
    parent = nn.ModuleDict({"layer": _layer(), "head": nn.Linear(K, N, bias=False)})
    parent["head"].weight = parent["layer"].weight1
    return parent


def _aliased() -> nn.Module:
    """One layer registered under two names."""
    layer = _layer()
    return nn.ModuleDict({"first": layer, "again": layer})


def _parametrized() -> nn.Module:
    """A second layer one of whose weights is parametrized (the first must stay unsharded)."""
    parent = nn.ModuleDict({"a": _layer(), "b": _layer()})
    torch.nn.utils.parametrize.register_parametrization(parent["b"], "weight2", nn.Identity())
    return parent


def _fsdp_param() -> GroupedLinear:
    layer = _layer()
    vars(layer.weight1)["__fsdp_param__"] = True
    return layer


def _odd_member() -> GroupedLinear:
    layer = _layer()
    layer.weight2 = nn.Parameter(torch.randn(N, K + 1))
    return layer


def _full(layer: nn.Module, **changes: Tensor) -> dict[str, Tensor]:
    """A valid full state for ``layer`` (other values than it holds), with ``changes``."""
    full = {f"weight{e}": torch.randn(N, K) for e in range(E)}
    full.update({f"bias{e}": torch.randn(N) for e in range(E)} if hasattr(layer, "bias0") else {})
    full.update(changes)
    return full


def _fake_ddp() -> DistributedDataParallel:
    wrapper = DistributedDataParallel.__new__(DistributedDataParallel)
    nn.Module.__init__(wrapper)
    wrapper.module = _sharded()
    return wrapper


def _params(layer: nn.Module) -> list[Tensor]:
    return [p for _, p in named_sharded_parameters(layer)]


def _weight1_without_main_grad() -> GroupedLinear:
    layer = _sharded()
    layer.weight1.main_grad = None
    return layer


def _weight0_main_grad_transposed() -> GroupedLinear:
    layer = _sharded()
    layer.weight0.main_grad = torch.full((K, N // 2), math.nan)
    return layer


def _group(layer: nn.Module) -> ExpertShardGroup:
    leader = layer.weight0
    assert isinstance(leader, ShardedExpertWeight)
    return leader.shard_group


CASES = [
    # shard_expert_weights
    Case("shard/not-a-module", _layer, lambda m: shard_expert_weights([m]), TypeError,
         r"module is a list, expected a torch.nn.Module"),
    Case("shard/grad_reduction", _layer, lambda m: shard_expert_weights(m, grad_reduction="avg"),
         ValueError, r"grad_reduction is 'avg', expected 'sum' or 'mean'"),
    Case("shard/main_grad_dtype", _layer,
         lambda m: shard_expert_weights(m, main_grad_dtype=torch.int32), ValueError,
         r"main_grad_dtype is torch.int32, expected one of torch.float32"),
    Case("shard/no-grouped-linear", lambda: nn.Linear(4, 4), shard_expert_weights, ValueError,
         r"module \(Linear\) contains no GroupedLinear"),
    Case("shard/rows-not-divisible-in-second-layer", _mlp_with_bad_fc2, shard_expert_weights,
         ValueError, r"'fc2.weight0' has 5 rows \(out_features\), not divisible by .* world "
         r"size 2"),
    Case("shard/already-sharded", _sharded, shard_expert_weights, ValueError,
         r"'weight0' is already a DistributedWeight \(ShardedExpertWeight\)"),
    Case("shard/tied-weights", _tied, shard_expert_weights, ValueError,
         r"^'a\.weight0' is also 'b\.weight0': a weight tied to another module's, or a layer "
         r"registered under two names, cannot be sharded"),
    Case("shard/tied-to-a-linear", _tied_to_a_linear, shard_expert_weights, ValueError,
         r"^'layer\.weight1' is also 'head\.weight': a weight tied"),
    Case("shard/layer-under-two-names", _aliased, shard_expert_weights, ValueError,
         r"^'first\.weight0' is also 'again\.weight0': .* registered under two names"),
    Case("shard/parametrized-weight", _parametrized, shard_expert_weights, ValueError,
         r"^'b\.weight2' is parametrized \(torch\.nn\.utils\.parametrize\); expected a plain"),
    Case("shard/megatron-fsdp-param", _fsdp_param, shard_expert_weights, ValueError,
         r"'weight1' is a Megatron-FSDP parameter"),
    Case("shard/deepcopy-of-a-sharded-module", _sharded, copy.deepcopy, RuntimeError,
         r"a ShardedExpertWeight cannot be deep-copied: .* deep-copy the module before "
         r"shard_expert_weights"),
    Case("shard/member-shape", _odd_member, shard_expert_weights, ValueError,
         r"'weight2' is \(6, 5\) torch.float32 on cpu, expected \(6, 4\) torch.float32 on cpu "
         r"like 'weight0'"),
    # gather_full_weights, full_state_dict
    Case("gather/not-a-module", _sharded, lambda m: gather_full_weights(dict(m.named_parameters())),
         TypeError, r"module is a dict, expected a torch.nn.Module"),
    Case("full_state_dict/not-a-module", _sharded, lambda m: full_state_dict([m]), TypeError,
         r"module is a list, expected a torch.nn.Module"),
    # load_full_state_dict
    Case("load_full/not-a-module", _sharded, lambda m: load_full_state_dict(None, _full(m)),
         TypeError, r"module is a NoneType, expected a torch.nn.Module"),
    Case("load_full/state-not-a-mapping", _sharded,
         lambda m: load_full_state_dict(m, list(_full(m).values())), TypeError,
         r"state is a list, expected a mapping of name to tensor"),
    Case("load_full/entry-not-a-tensor", _sharded,
         lambda m: load_full_state_dict(m, _full(m, weight0=[[0.0] * K] * N)), TypeError,
         r"state\['weight0'\] is a list, expected a tensor"),
    Case("load_full/shard-shaped-weight", _sharded,
         lambda m: load_full_state_dict(m, _full(m, weight1=torch.randn(N // 2, K))), ValueError,
         r"state\['weight1'\] has shape \(3, 4\), expected \(6, 4\) \(the full weight\)"),
    Case("load_full/bias-shape-after-good-weights", lambda: _sharded(bias=True),
         lambda m: load_full_state_dict(m, _full(m, bias2=torch.randn(N + 1))), ValueError,
         r"state\['bias2'\] has shape \(7,\), expected \(6,\)"),
    Case("load_full/missing-key", _sharded,
         lambda m: load_full_state_dict(m, {"weight0": torch.randn(N, K)}), ValueError,
         r"strict=True\): missing keys \['weight1', 'weight2'\], unexpected keys \[\]"),
    Case("load_full/unexpected-key", _sharded,
         lambda m: load_full_state_dict(m, _full(m, weight3=torch.randn(N, K))), ValueError,
         r"missing keys \[\], unexpected keys \['weight3'\]"),
    # module.load_state_dict through the sharded module's hook
    Case("load_state_dict/shard-shaped-plain-tensor", _sharded,
         lambda m: m.load_state_dict(_full(m, weight2=torch.randn(N // 2, K))), RuntimeError,
         r"state_dict\['weight2'\] is a tensor of shape \(3, 4\), expected the full weight's "
         r"shape \(6, 4\) .* carries no record of whose rows it holds"),
    Case("load_state_dict/wrong-shape", _sharded,
         lambda m: m.load_state_dict(_full(m, weight0=torch.randn(N, K + 2))), RuntimeError,
         r"state_dict\['weight0'\] is a tensor of shape \(6, 6\), expected the full weight's "
         r"shape \(6, 4\)"),
    # ddp_ignore_sharded
    Case("ddp_ignore/not-a-module", _sharded, lambda m: ddp_ignore_sharded("model"), TypeError,
         r"module is a str, expected a torch.nn.Module"),
    Case("ddp_ignore/already-wrapped", _fake_ddp, ddp_ignore_sharded, TypeError,
         r"module is already a DistributedDataParallel.* call ddp_ignore_sharded\(model\) on the "
         r"unwrapped model"),
    Case("ddp_ignore/nothing-sharded", _layer, ddp_ignore_sharded, ValueError,
         r"module \(GroupedLinear\) holds no sharded expert weight; call shard_expert_weights"),
    # MasterWeights
    Case("masters/empty", _sharded, lambda m: MasterWeights([]), ValueError,
         r"params is empty"),
    Case("masters/single-tensor", _sharded, lambda m: MasterWeights(m.weight0), TypeError,
         r"params is a single tensor"),
    Case("masters/integer-tensor", _sharded,
         lambda m: MasterWeights([torch.zeros(2, dtype=torch.int64)]), TypeError,
         r"params\[0\] is a torch.int64, expected a floating-point tensor"),
    Case("masters/twice", _sharded, lambda m: MasterWeights([m.weight0, m.weight0]), ValueError,
         r"params\[1\] appears twice"),
    Case("masters/no-main_grad", _weight1_without_main_grad, lambda m: MasterWeights(_params(m)),
         ValueError, r"params\[1\] \(shape \(3, 4\)\) has no main_grad"),
    Case("masters/main_grad-shape", _weight0_main_grad_transposed,
         lambda m: MasterWeights(_params(m)),
         ValueError, r"params\[0\].main_grad has shape \(4, 3\), expected the parameter's shape "
         r"\(3, 4\)"),
    Case("masters/dtype", _sharded, lambda m: MasterWeights(_params(m), dtype=torch.int32),
         ValueError, r"dtype is torch.int32, expected a floating-point torch.dtype"),
    Case("masters/load-keys", _sharded,
         lambda m: MasterWeights(_params(m)).load_state_dict({"masters": []}), ValueError,
         r"state has \['masters'\], expected MasterWeights\.state_dict\(\)'s 'masters' and "
         r"'rank'"),
    Case("masters/load-count", _sharded,
         lambda m: MasterWeights(_params(m)).load_state_dict({"rank": dist.get_rank(), "masters": []}),
         ValueError, r"state holds 0 masters, expected 3"),
    Case("masters/load-shape", _sharded,
         lambda m: MasterWeights(_params(m)).load_state_dict(
             {"rank": dist.get_rank(), "masters": [torch.zeros(N, K)] * 3}),
         ValueError, r"state's masters\[0\] has shape \(6, 4\), expected \(3, 4\)"),
    Case("masters/load-rank", _sharded,
         lambda m: MasterWeights(_params(m)).load_state_dict(
             {"rank": 1 - dist.get_rank(), "masters": []}),
         ValueError, r"state holds rank (\d)'s masters, this is rank (?!\1)\d: each rank loads"),
    # the shard group's reduction, before its collective
    Case("reduce/wgrads-count", _sharded,
         lambda m: _group(m).reduce_scatter_grads([torch.zeros(N, K)] * 2), ValueError,
         r"wgrads has 2 entries, expected 3 \(one per member of the group led by 'weight0'\)"),
    Case("reduce/wgrad-shape", _sharded,
         lambda m: _group(m).reduce_scatter_grads([torch.zeros(N, K)] * 2 + [torch.zeros(K, N)]),
         ValueError, r"wgrad of 'weight2' has shape \(4, 6\), expected the full weight's shape "
         r"\(6, 4\)"),
    Case("reduce/trainable-member-without-main_grad", _weight1_without_main_grad,
         lambda m: _group(m).reduce_scatter_grads([torch.zeros(N, K)] * 3),
         RuntimeError, r"sharded weight 'weight1' has no main_grad tensor"),
    Case("reduce/main_grad-shape", _weight0_main_grad_transposed,
         lambda m: _group(m).reduce_scatter_grads([torch.zeros(N, K)] * 3),
         RuntimeError, r"main_grad of 'weight0' has shape \(4, 3\), expected the shard's shape "
         r"\(3, 4\)"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_raises_naming_the_argument_and_writes_nothing(case: Case) -> None:
    module = case.build()
    target = module.module if isinstance(module, DistributedDataParallel) else module
    before = Snapshot.of(target)
    with pytest.raises(case.error, match=case.match):
        case.call(module)
    before.assert_unchanged(target)


def test_uninitialized_process_group_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    before = Snapshot.of(layer)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized; call "):
        shard_expert_weights(layer)
    before.assert_unchanged(layer)


def test_a_process_outside_the_group_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    before = Snapshot.of(layer)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: -1)
    with pytest.raises(ValueError, match=r"global rank -1\) is not a member of process_group"):
        shard_expert_weights(layer, object())  # type: ignore[arg-type]
    before.assert_unchanged(layer)


# --- valid edges ----------------------------------------------------------------------------


def test_nothing_sharded_gathers_nothing() -> None:
    assert gather_full_weights(_layer()) == {}  # and runs no collective (there is no group)


def test_load_full_state_dict_not_strict_loads_what_it_is_given() -> None:
    layer = _sharded()
    weight1 = torch.randn(N, K)
    untouched = {n: p.detach().clone() for n, p in named_sharded_parameters(layer)}
    load_full_state_dict(layer, {"weight1": weight1}, strict=False)
    assert torch.equal(layer.weight1.detach(), weight1[N // 2 :])
    assert torch.equal(layer.weight0.detach(), untouched["weight0"])
    assert torch.equal(layer.weight2.detach(), untouched["weight2"])
    assert layer.weight1.main_grad.isnan().all()  # loading never touches main_grad


def test_full_tensors_load_through_load_state_dict_too() -> None:
    layer = _sharded(bias=True)
    full = _full(layer)
    layer.load_state_dict(full)
    for name, value in full.items():
        rows = value[N // 2 :] if name.startswith("weight") else value
        assert torch.equal(getattr(layer, name).detach(), rows), name


def test_master_weights_of_a_frozen_parameter_get_no_grad_and_do_not_move() -> None:
    layer = _sharded()
    layer.weight1.requires_grad_(False)
    for _, param in named_sharded_parameters(layer):
        param.main_grad.fill_(1.0)  # type: ignore[attr-defined]
    masters = MasterWeights(_params(layer))
    optimizer = torch.optim.SGD(masters.parameters(), lr=0.5)
    frozen_before = layer.weight1.detach().clone()
    masters.step(optimizer)
    assert torch.equal(layer.weight1.detach(), frozen_before)
    assert torch.equal(layer.weight0.detach(), (masters.parameters()[0] + 0).detach())
    assert not masters.parameters()[1].requires_grad


def test_ddp_ignore_list_merges_with_what_was_there() -> None:
    model = nn.Sequential(nn.Linear(K, K), _layer(bias=True))
    model._ddp_params_and_buffers_to_ignore = ["0.bias"]  # type: ignore[assignment]
    shard_expert_weights(model[1])
    names = ddp_ignore_sharded(model)
    assert names == ["1.weight0", "1.weight1", "1.weight2"]
    assert model._ddp_params_and_buffers_to_ignore == ["0.bias", *names]
    root = model[1]._ddp_params_and_buffers_to_ignore  # its own list: root names, both spellings
    assert root == ["weight0", ".weight0", "weight1", ".weight1", "weight2", ".weight2"]
