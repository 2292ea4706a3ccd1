"""The FSDP2 training scenarios and the checks of one scenario's results against its replays.

A scenario is a plain dict (it travels to the worker processes): the model
shape of :data:`moe_model.SHAPE` plus

=================  ==============================================================
``module``         ``"mlp"`` (``GroupedMLP``) or ``"linear"`` (two ``GroupedLinear``)
``packed``         one ``(E, ·, ·)`` parameter per layer (``single_grouped_weight``)
``bias``           per-expert biases in both layers
``bf16``           ``param_dtype=bf16`` (the ``grad_dtype`` route is active), else fp32
``integration``    ``groupgrad.integrations.fsdp2.fully_shard`` (else plain FSDP2)
``reshard``        ``reshard_after_forward``
``experts_unit``   the experts are an FSDP unit of their own inside each block
``empty_expert``   rank 1 sends block 0's expert 2 no token
``dcp``            save and load through DCP before the last step (fresh model)
``compile``        ``None``; ``"block"``: ``torch.compile(block, fullgraph=True)`` per
                   block before sharding (torchtitan's way); ``"block_ac"``: the same
                   around activation checkpointing; ``"root"``: the sharded model compiled
``steps``, ``micro_batches``, ``lr``, ``momentum``  the SGD loop
=================  ==============================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from groupgrad_testsupport import assert_as_close_as_torch, assert_close

BASE: dict[str, Any] = {
    "seed": 0,
    "module": "mlp",
    "packed": False,
    "bias": True,
    "bf16": True,
    "integration": True,
    "reshard": True,
    "experts_unit": False,
    "empty_expert": True,
    "dcp": False,
    "compile": None,
    "steps": 2,
    "micro_batches": 2,
    "lr": 0.1,
    "momentum": 0.0,
}


def scenario(name: str, shape: Mapping[str, Any], seed: int, **options: Any) -> dict[str, Any]:
    return {**BASE, **shape, "name": name, "seed": seed, **options}


def two_rank(shape: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each module × layout in bf16 compute (reshard after forward on and off between them),
    fp32 precision checks, DCP, reduce-scatters."""
    found = []
    for seed, (module, packed, reshard) in enumerate(
        [
            ("mlp", False, True),
            ("mlp", True, False),
            ("linear", False, False),
            ("linear", True, True),
        ],
        start=10,
    ):
        layout = "packed" if packed else "per_expert"
        name = f"{module}_{layout}_bf16_reshard_{'on' if reshard else 'off'}"
        found.append(scenario(name, shape, seed, module=module, packed=packed, reshard=reshard))
    found += [
        scenario("mlp_per_expert_fp32", shape, 30, bf16=False),
        scenario(
            "linear_packed_fp32_no_bias",
            shape,
            31,
            module="linear",
            packed=True,
            bias=False,
            bf16=False,
        ),
        scenario(
            "mlp_packed_fp32_dcp",
            shape,
            32,
            packed=True,
            bf16=False,
            dcp=True,
            steps=3,
            momentum=0.9,
        ),
        scenario(
            "mlp_per_expert_bf16_dcp",
            shape,
            33,
            dcp=True,
            steps=3,
            momentum=0.9,
            empty_expert=False,
            micro_batches=1,
            tokens=64,
        ),
    ]
    found += reduce_scatter_scenarios(shape, 40)
    found += compile_scenarios({**shape, "tokens": 64}, 60)
    return found


def compile_scenarios(shape: Mapping[str, Any], seed: int) -> list[dict[str, Any]]:
    """bf16 compute under ``torch.compile``: per block, per block with activation
    checkpointing, and the whole sharded model, one micro-batch per step and every
    expert used, so the reduce-scatter check applies; per block with two micro-batches."""
    options = {"empty_expert": False, "micro_batches": 1}
    return [
        scenario("compile_block_mlp_per_expert", shape, seed, compile="block", **options),
        scenario(
            "compile_block_ac_mlp_packed",
            shape,
            seed + 1,
            compile="block_ac",
            packed=True,
            **options,
        ),
        scenario(
            "compile_root_linear_packed",
            shape,
            seed + 2,
            compile="root",
            module="linear",
            packed=True,
            **options,
        ),
        # two micro-batches, the first without sync, other routings: splits is a tensor
        # (moe_model), so no recompile meets the fp32 gradient the first leaves on the
        # unsharded bf16 parameters (README: Dynamo refuses to trace those)
        scenario("compile_block_mlp_accumulate", shape, seed + 3, compile="block"),
    ]


def reduce_scatter_scenarios(shape: Mapping[str, Any], seed: int) -> list[dict[str, Any]]:
    """bf16 compute, every expert used on every rank; experts in the block unit and on their own.

    One micro-batch per step: with two, plain FSDP2 accumulates the first
    micro-batch's bf16 wgrad in fp32 and adds the second, so its
    reduce-scatter input is a sum of two bf16 values rather than one.
    """
    found = []
    for integration in (True, False):
        for experts_unit in (False, True):
            tag = "groupgrad" if integration else "plain_fsdp2"
            unit = "experts_unit" if experts_unit else "block_unit"
            found.append(
                scenario(
                    f"reduce_scatter_{unit}_{tag}",
                    shape,
                    seed,
                    integration=integration,
                    experts_unit=experts_unit,
                    empty_expert=False,
                    micro_batches=1,
                    tokens=64,
                )
            )
    return found


def four_rank(shape: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        scenario("mlp_packed_bf16_4", shape, 50, packed=True),
        scenario("linear_per_expert_fp32_4", shape, 51, module="linear", bf16=False),
        *reduce_scatter_scenarios(shape, 52)[:2],
    ]


# ------------------------------------------------------------------ checks


def close(actual: Tensor, expected: Tensor, what: str, rel: float = 1e-5) -> None:
    """Every element within ``rel`` × the largest ``|expected|`` (NaN fails)."""
    limit = rel * float(expected.double().abs().max())
    assert_close(actual, expected, rtol=0.0, atol=limit, what=what)


def bf16_rule(triples: Sequence[tuple[Tensor, Tensor, Tensor]], what: str) -> tuple[float, float]:
    """At most twice PyTorch's own bf16 error against fp64, over a group of tensors.

    ``triples`` are ``(ours, PyTorch's bf16, fp64)``. Each tensor's errors are
    normalised by its fp64 maximum, and the rule applies to the group's
    largest error (plus one bf16 ulp, ``2**-8``) and to its mean error: per
    tensor, a 4-element bias gradient summed from cancelling terms makes
    both errors single random draws whose ratio proves nothing.

    Returns:
        ``(ours / PyTorch's)`` for the max and the mean.
    """
    ours, theirs, exact = [], [], []
    for actual, torch_bf16, fp64 in triples:
        assert actual.shape == fp64.shape, (what, actual.shape, fp64.shape)
        scale = fp64.double().abs().max().clamp_min(1e-30)
        ours.append((actual.double() / scale).flatten())
        theirs.append((torch_bf16.double() / scale).flatten())
        exact.append((fp64.double() / scale).flatten())
    mine, yours, oracle = torch.cat(ours), torch.cat(theirs), torch.cat(exact)
    assert_as_close_as_torch(mine, oracle, yours, atol=2**-8, what=f"{what} (normalised)")
    mine_err, your_err = (mine - oracle).abs(), (yours - oracle).abs()
    assert mine_err.mean() <= 2 * your_err.mean(), (
        f"{what}: mean error {float(mine_err.mean()):.3e} > 2 × {float(your_err.mean()):.3e}"
    )
    return float(mine_err.max() / your_err.max()), float(mine_err.mean() / your_err.mean())


def check_training(
    cfg: Mapping[str, Any],
    ranks: Sequence[Mapping[str, Any]],
    fp64: Mapping[str, Any],
    torch_bf16: Mapping[str, Any] | None,
) -> None:
    """Outputs, input grads, reduced grads and weights of every rank against the replays.

    fp32 scenarios: every tensor of every step within 1e-5 of fp64 (relative
    to its maximum). bf16 scenarios: :func:`bf16_rule` per group on the first
    step — its outputs, input gradients, expert gradients, other gradients
    and the weights after it. (Later bf16 steps start from weights that
    drifted apart, ours and PyTorch's each its own way; the fp32 scenarios
    check every step.)
    """
    world, micro_batches, steps = len(ranks), cfg["micro_batches"], cfg["steps"]
    for step in range(steps):
        for name, grad in ranks[0]["grads"][step].items():
            for rank in range(1, world):
                assert torch.equal(ranks[rank]["grads"][step][name], grad), (name, rank)
    groups: dict[str, list[tuple[Tensor, Tensor | None, Tensor]]] = {}

    def add(group: str, actual: Tensor, path: tuple[Any, ...]) -> None:
        def pick(run: Mapping[str, Any]) -> Tensor:
            found: Any = run
            for key in path:
                found = found[key]
            return found

        expected = pick(fp64)
        if not cfg["bf16"]:
            close(actual, expected, f"{group} {path[1:]}")
            return
        assert torch_bf16 is not None
        groups.setdefault(group, []).append((actual, pick(torch_bf16), expected))

    checked = 1 if cfg["bf16"] else steps
    for rank, result in enumerate(ranks):
        for i, (out, dx) in enumerate(zip(result["outs"], result["dxs"], strict=True)):
            step, micro = divmod(i, micro_batches)
            if step < checked:
                add("outputs", out, ("outs", (step, rank, micro)))
                add("input grads", dx, ("dxs", (step, rank, micro)))
    for step in range(checked):
        for name, grad in ranks[0]["grads"][step].items():
            kind = "expert" if is_expert(name) else "other"
            add(f"{kind} grads at step {step}", grad, ("grads", step, name))
        for name, weight in ranks[0]["weights"][step].items():
            add(f"weights after step {step}", weight, ("weights", step, name))
    for group, triples in groups.items():
        bf16_rule([(a, b, c) for a, b, c in triples if b is not None], group)


def check_reduce_scatters(
    cfg: Mapping[str, Any], ranks: Sequence[Mapping[str, Any]], rs: Any
) -> dict:
    """Every reduce-scatter input fp32, one per unit and step; returns bf16-exact fractions per unit.

    The fractions are over the groupgrad parameters' elements (experts) and
    over the unit's other parameters, per unit, on every rank and step.
    """
    world = len(ranks)
    shapes = {name: grad.shape for name, grad in ranks[0]["grads"][0].items()}
    fractions: dict[str, dict[str, list[float]]] = {}
    for result in ranks:
        log = result["reduce_scatters"]
        units = result["unit_params"]
        assert len(log) == cfg["steps"] * len(units), ([e["unit"] for e in log], list(units))
        for entry in log:
            assert entry["input"].dtype == torch.float32, (entry["unit"], entry["input"].dtype)
            parts = rs.segments(entry["input"], units[entry["unit"]], shapes, world)
            experts = [t for n, t in parts.items() if is_expert(n)]
            others = [t for n, t in parts.items() if not is_expert(n)]
            found = fractions.setdefault(entry["unit"], {"experts": [], "others": []})
            if experts:
                found["experts"].append(rs.representable_in_bf16(torch.cat(experts)))
            if others:
                found["others"].append(rs.representable_in_bf16(torch.cat(others)))
    return fractions


def is_expert(name: str) -> bool:
    return ".experts." in name or ".fc1." in name or ".fc2." in name
