"""Sharded expert weights trained by real gloo processes, against a single-process fp64 reference.

Each scenario: every rank builds the same module, shards it with
``shard_expert_weights``, and trains ``steps`` SGD steps of ``micro_batches``
micro-batches on data of its own (one rank gets an expert with no token). The
parent recomputes everything in one process with plain fp64 autograd on the
full weights and compares: outputs and input gradients; every ``main_grad``
shard after every micro-batch (accumulate: running sum or mean over ranks and
micro-batches; overwrite: that micro-batch alone, over a NaN-poisoned
``main_grad``); the flag and the zero dummies autograd got (re-zeroed under
``zero_out_wgrad`` after the "framework" added into one); the gathered
full weights after each step; and the collectives each micro-batch ran (one
all-gather per materialization, one fp32 reduce-scatter per layer).

Two launches (2 and 4 ranks) run every scenario; each test reads their results.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from groupgrad_testsupport import (
    Launches,
    assert_as_close_as_torch,
    assert_close,
    launch,
    load_sibling,
    max_abs_error,
)

ref = load_sibling(__file__, "reference")
WORKER = Path(__file__).with_name("sharded_worker.py")

LINEAR = {"module": "linear", "experts": 3, "in_features": 8, "out_features": 12, "tokens": 12}
MLP = {"module": "mlp", "experts": 3, "hidden": 8, "ffn_hidden": 6, "tokens": 12}
DEFAULTS = {
    "packed": False,
    "dtype": "float32",
    "reduction": "mean",
    "mode": "accumulate",
    "delay": False,
    "leader_only": False,
    "zero_out": False,
    "steps": 2,
    "micro_batches": 2,
    "lr": 0.5,
}


def scenario(name: str, shape: dict[str, Any], seed: int, **options: Any) -> dict[str, Any]:
    return {"name": name, **DEFAULTS, **shape, "seed": seed, **options}


def _two_rank_scenarios() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for module, shape in (("linear", LINEAR), ("mlp", MLP)):
        for packed in (False, True):
            layout = "packed" if packed else "per_expert"
            variants: dict[str, dict[str, Any]] = {
                "accumulate_mean": {},
                "accumulate_sum": {"reduction": "sum"},
                "overwrite": {"mode": "overwrite", "reduction": "sum" if packed else "mean"},
                "delay": {"delay": True, "reduction": "mean" if packed else "sum"},
                "delay_overwrite": {"delay": True, "mode": "overwrite"},
            }
            for variant, options in variants.items():
                name = f"{module}-{layout}-{variant}"
                found.append(scenario(name, shape, len(found) + 1, packed=packed, **options))
    found.append(scenario("linear-per_expert-leader_only", LINEAR, 41, leader_only=True))
    found.append(scenario("linear-per_expert-zero_out", LINEAR, 43, zero_out=True))
    found.append(scenario("mlp-per_expert-leader_only", MLP, 42, leader_only=True, reduction="sum"))
    for packed in (False, True):
        name = f"linear-{'packed' if packed else 'per_expert'}-bf16"
        found.append(scenario(name, LINEAR, 50 + packed, packed=packed, dtype="bfloat16", steps=1))
    return found


TWO_RANKS = _two_rank_scenarios()
FOUR_RANKS = [
    scenario("linear-per_expert-accumulate_mean", LINEAR, 61),
    scenario(
        "mlp-packed-delay_overwrite_sum",
        MLP,
        62,
        packed=True,
        delay=True,
        mode="overwrite",
        reduction="sum",
    ),
]
ERRORS = {"name": "errors"}
CASES = [(2, s["name"]) for s in TWO_RANKS] + [(4, s["name"]) for s in FOUR_RANKS]
BF16_CASES = [case for case in CASES if case[1].endswith("bf16")]


class Run:
    """One launch's results, with each scenario's fp64 reference computed once."""

    def __init__(self, results: dict[str, list[dict[str, Any]]]) -> None:
        self.results = results
        self._references: dict[str, Any] = {}

    def reference(self, name: str) -> Any:
        if name not in self._references:
            self._references[name] = ref.build_reference(self.results[name])
        return self._references[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Run]:
    """Launch each world size once, at the first test that needs it; a failed launch fails all."""
    launches = Launches(tmp_path_factory, WORKER, {2: [*TWO_RANKS, ERRORS], 4: FOUR_RANKS})
    wrapped: dict[int, Run] = {}

    def get(world_size: int) -> Run:
        if world_size not in wrapped:
            wrapped[world_size] = Run(launches(world_size))
        return wrapped[world_size]

    return get


def _case(runs: Callable[[int], Run], case: tuple[int, str]) -> tuple[int, str, list[dict], Any]:
    """A case's world size, name, per-rank results and fp64 reference."""
    world, name = case
    run = runs(world)
    return world, name, run.results[name], run.reference(name)


def _ids(case: tuple[int, str]) -> str:
    return f"{case[0]}ranks-{case[1]}"


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: str, what: str) -> None:
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert_close(actual, expected, rtol=tol, atol=tol, what=what)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_outputs_and_input_grads_match_reference(runs: Callable[[int], Run], case: tuple) -> None:
    _, name, ranks, reference = _case(runs, case)
    for rank, result in enumerate(ranks):
        dtype = result["config"]["dtype"]
        for index, (got, want) in enumerate(
            zip(result["micro"], reference.micro[rank], strict=True)
        ):
            where = f"{name} rank {rank} micro-batch {index}"
            if dtype == "bfloat16":
                _check_bf16_rule(result["config"], result["init"], got, want, where)
                continue
            _close(got["y"], want.y, dtype, f"{where} y")
            _close(got["dx"], want.dx, dtype, f"{where} dx")
            if want.dprobs is not None:
                _close(got["dprobs"], want.dprobs, dtype, f"{where} dprobs")


def _check_bf16_rule(cfg: dict, init: dict, got: dict, want: Any, where: str) -> None:
    """bf16 y and dx err at most twice PyTorch's own bf16 computation, plus a small atol."""
    weights = {n: w.bfloat16() for n, w in init.items()}
    x = got["x"].bfloat16().requires_grad_(True)
    y_torch = ref.forward(cfg, weights, x, got["splits"], None)
    y_torch.backward(got["dy"].bfloat16())
    assert x.grad is not None
    for label, ours, torchs, exact in (
        ("y", got["y"], y_torch, want.y),
        ("dx", got["dx"], x.grad, want.dx),
    ):
        assert ours.dtype == torch.bfloat16, f"{where} {label} has dtype {ours.dtype}"
        assert_as_close_as_torch(ours, exact, torchs, atol=1e-3, what=f"{where} {label}")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_main_grad_shards_hold_the_reduced_gradient_rows(
    runs: Callable[[int], Run], case: tuple
) -> None:
    world, name, ranks, reference = _case(runs, case)
    for rank, result in enumerate(ranks):
        for index, got in enumerate(result["micro"]):
            for param, expected in reference.main_grads[index].items():
                shard = got["main_grads"][param]
                where = f"{name} rank {rank} micro-batch {index} {param}.main_grad"
                assert shard.dtype == torch.float32, f"{where} has dtype {shard.dtype}"
                assert not shard.isnan().any(), f"{where} has NaN: an overwrite left rows unwritten"
                _close(shard, ref.rows_of(expected, rank, world), "float32", where)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_flags_dummies_and_shapes(runs: Callable[[int], Run], case: tuple) -> None:
    world, name = case
    for rank, result in enumerate(runs(world).results[name]):
        cfg = result["config"]
        assert all(result["leaders_are_protocol"]), f"{name}: a leader is not a DistributedWeight"
        for param, full in result["init"].items():
            expected_shape = (*full.shape[:-2], full.shape[-2] // world, full.shape[-1])
            assert result["shard_shapes"][param] == expected_shape, f"{name} {param}"
            leader = param.rsplit(".", 1)[-1] in ("weight0", "weight")
            want_type = "ShardedExpertWeight" if leader or not cfg["leader_only"] else "Parameter"
            assert result["types"][param] == want_type, f"{name} {param}"
        for index, got in enumerate(result["micro"]):
            where = f"{name} rank {rank} micro-batch {index}"
            assert all(got["flags"].values()), f"{where}: grad_added_to_main_grad {got['flags']}"
            for param, grad in got["grads"].items():
                assert grad is not None, f"{where}: {param}.grad is None, expected a zero dummy"
                assert grad.shape == result["shard_shapes"][param], f"{where} {param}.grad"
                assert grad.dtype == getattr(torch, cfg["dtype"]), f"{where} {param}.grad"
                assert not grad.any(), f"{where}: {param}.grad is not all zero"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gathered_weights_after_sgd_steps_match_reference(
    runs: Callable[[int], Run], case: tuple
) -> None:
    _, name, ranks, reference = _case(runs, case)
    for rank, result in enumerate(ranks):
        assert result["init"].keys() == ranks[0]["init"].keys()
        for param, full in result["init"].items():  # every rank built the same model
            assert torch.equal(full, ranks[0]["init"][param]), f"{name} {param}"
        for step, gathered in enumerate(result["after_step"]):
            for param, expected in reference.after_step[step].items():
                where = f"{name} rank {rank} after step {step}: {param}"
                _close(gathered[param], expected, result["config"]["dtype"], where)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_one_all_gather_per_materialization_one_fp32_reduce_scatter_per_layer(
    runs: Callable[[int], Run], case: tuple
) -> None:
    world, name = case
    for rank, result in enumerate(runs(world).results[name]):
        cfg = result["config"]
        layers = _layer_numels(cfg)
        op = "AVG" if cfg["reduction"] == "mean" else "SUM"
        for index, got in enumerate(result["micro"]):
            where = f"{name} rank {rank} micro-batch {index}"
            gathers = [c for c in got["collectives"] if c["kind"] == "all_gather"]
            reductions = [c for c in got["collectives"] if c["kind"] == "reduce_scatter"]
            assert len(gathers) == 2 * len(layers), f"{where}: {got['collectives']}"
            assert len(reductions) == len(layers), f"{where}: {got['collectives']}"
            for call in gathers:  # forward and backward each gather a layer's group once
                assert call["input_dtype"] == f"torch.{cfg['dtype']}", f"{where}: {call}"
                assert call["input_numel"] * world in layers, f"{where}: {call}"
            for call in reductions:
                assert call["input_dtype"] == call["output_dtype"] == "torch.float32", where
                assert op in call["op"], f"{where}: {call}"
            assert sorted(c["input_numel"] for c in reductions) == sorted(layers), where


def _layer_numels(cfg: dict[str, Any]) -> list[int]:
    """Full elements of each sharded layer's weight group."""
    E = cfg["experts"]
    if cfg["module"] == "linear":
        return [E * cfg["out_features"] * cfg["in_features"]]
    H, F = cfg["hidden"], cfg["ffn_hidden"]
    return [E * 2 * F * H, E * H * F]


@pytest.mark.parametrize("case", BF16_CASES, ids=_ids)
def test_bf16_weights_reduce_in_fp32(runs: Callable[[int], Run], case: tuple) -> None:
    """bf16 weights, fp32 main_grad: the reduce-scatter saw fp32 and beats a bf16 one by far."""
    world, name, ranks, reference = _case(runs, case)
    for rank, result in enumerate(ranks):
        assert all(p.dtype == torch.bfloat16 for p in result["init"].values())
        for index, got in enumerate(result["micro"]):
            dtypes = {c["input_dtype"] for c in got["collectives"] if c["kind"] == "reduce_scatter"}
            assert dtypes == {"torch.float32"}, f"{name} reduce-scatter saw {dtypes}"
            for param, expected in reference.main_grads[index].items():
                rows = ref.rows_of(expected, rank, world)
                bf16_rows = ref.rows_of(reference.bf16_reduced[index][param], rank, world)
                ours = max_abs_error(got["main_grads"][param], rows)
                bf16 = max_abs_error(bf16_rows, rows)
                scale = rows.abs().max().item()
                where = f"{name} rank {rank} micro-batch {index} {param}"
                assert bf16 > 1e-4 * scale, f"{where}: the bf16 baseline is too exact to compare"
                assert ours < bf16 / 100, f"{where}: error {ours:.3g} vs bf16 reduction {bf16:.3g}"


def test_errors_raised_on_every_rank(runs: Callable[[int], Run]) -> None:
    """Non-divisible rows, sharding twice, a missing main_grad (checked inside both ranks)."""
    for result in runs(2).results["errors"]:
        assert result == {"errors_checked": 3}


@pytest.mark.gpu(2)
def test_nccl_two_gpus(tmp_path: Path) -> None:
    """The bf16 and fp32 scenarios on 2 GPUs with NCCL (CUTLASS kernels where they apply)."""
    chosen = [s for s in TWO_RANKS if s["name"].endswith(("bf16", "accumulate_mean", "overwrite"))]
    run = Run(launch(WORKER, chosen, world_size=2, workdir=tmp_path, device="cuda", timeout_s=300))
    for cfg in chosen:
        name = cfg["name"]
        reference = run.reference(name)
        for rank, result in enumerate(run.results[name]):
            for index, got in enumerate(result["micro"]):
                dtypes = {
                    c["input_dtype"] for c in got["collectives"] if c["kind"] == "reduce_scatter"
                }
                assert dtypes == {"torch.float32"}, f"{name}: {dtypes}"
                for param, expected in reference.main_grads[index].items():
                    shard = got["main_grads"][param]
                    where = f"nccl {name} rank {rank} micro-batch {index} {param}"
                    _close(shard, ref.rows_of(expected, rank, 2), "float32", where)
