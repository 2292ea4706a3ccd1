"""groupgrad experts in the real Megatron-Core MoE layer, 2 gloo ranks, against SequentialMLP.

One 2-rank launch (``mcore_worker.py``, the CPU shim, Megatron's allgather
token dispatcher) runs every scenario of ``scenarios.py``; each test reads
its scenarios' per-rank results:

* fp32, expert parallelism 1 and 2, fused and unfused experts, with and
  without ``delay_wgrad_compute`` (``backward_dw()`` after each backward) and
  ``gradient_accumulation_fusion``: outputs, input gradients and every
  ``main_grad`` after two micro-batches under Megatron's DDP equal
  ``SequentialMLP``'s (same weights, same inputs); ``grad_added_to_main_grad``
  is set exactly when the wgrad went straight into ``main_grad``;
* bf16: within twice ``SequentialMLP``'s own error against its fp64 run;
* checkpoints saved by each backend and loaded by each other one;
* the checkpoint layout against ``TEGroupedMLP``'s (``te_layout.py``);
* ``init_method`` per expert and the attributes Megatron's DDP reads;
* setups that must be refused (expert tensor parallelism through the process
  groups, a delayed wgrad under a DDP that does not hand over its hooks);
* no op whose CUDA kernel sums atomically in the experts' step (fp32, bf16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from groupgrad_testsupport import Launches, load_sibling

WORKER = Path(__file__).with_name("mcore_worker.py")
scenarios = load_sibling(__file__, "scenarios")
checks = load_sibling(__file__, "checks")
te_layout = load_sibling(__file__, "te_layout")
SHAPE = load_sibling(__file__, "mcore_worker").SHAPE

TWO_RANKS = [
    *scenarios.FP32_LAYERS,
    *scenarios.BF16_LAYERS,
    *scenarios.CHECKPOINTS,
    *scenarios.LAYOUTS,
    *scenarios.INITS,
    *scenarios.ERRORS,
    *scenarios.ATOMICS,
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, WORKER, {2: TWO_RANKS}, timeout_s=600)


@pytest.fixture(scope="module")
def param_gather_runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, WORKER, {2: scenarios.PARAM_GATHER}, timeout_s=600)


def _names(items: list[dict[str, Any]]) -> list[str]:
    return [item["name"] for item in items]


# ---------------------------------------------------------------- layer numerics


@pytest.mark.parametrize("name", _names(scenarios.FP32_LAYERS))
def test_fp32_equals_sequential_mlp(runs: Launches, name: str) -> None:
    scenario = next(s for s in scenarios.FP32_LAYERS if s["name"] == name)
    expected_type = "GroupgradFusedExperts" if scenario["backend"] == "fused" else "TEGroupedMLP"
    for rank, result in enumerate(runs(2)[name]):
        where = f"{name} rank {rank}"
        assert result["experts_type"] == expected_type, where
        checks.assert_matches_sequential(result, where)
        assert result["groupgrad"]["untouched"], where
        flags = result["groupgrad"]["grad_added"]
        if scenario.get("frozen_experts"):  # no expert weight trains: no main_grad, no flag
            assert flags == {}, where
            assert not any(".experts." in f".{n}" for n in result["groupgrad"]["main_grad"])
            continue
        assert flags, where
        wanted = scenario.get("fusion", False)
        assert set(flags.values()) == {wanted}, (
            f"{where}: grad_added_to_main_grad {flags}, expected {wanted} on every expert weight "
            "(set by groupgrad exactly when its GEMM wrote main_grad)"
        )


@pytest.mark.parametrize("name", _names(scenarios.BF16_LAYERS))
def test_bf16_within_twice_sequential_mlps_error(runs: Launches, name: str) -> None:
    for rank, result in enumerate(runs(2)[name]):
        checks.assert_bf16_within_twice_sequential(result, f"{name} rank {rank}")


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("name", _names(scenarios.CHECKPOINTS))
def test_checkpoints_load_into_every_other_backend(runs: Launches, name: str) -> None:
    for rank, result in enumerate(runs(2)[name]):
        saved, loaded = result["saved"], result["loaded"]
        assert loaded, name
        for pair, weights in loaded.items():
            source, target = pair.split("->")
            where = f"{name} rank {rank}: saved by {source}, loaded by {target}"
            assert sorted(weights) == sorted(saved[source]), where
            for key, value in weights.items():
                # the backends were built with different weights: a load that did nothing fails
                assert not torch.equal(saved[target][key], saved[source][key]), f"{where}: {key}"
                assert torch.equal(value, saved[source][key]), f"{where}: {key} differs"


@pytest.mark.parametrize("mode", ["default", "singleton"])
@pytest.mark.parametrize("ep", [1, 2])
def test_checkpoint_layout_is_te_grouped_mlps(runs: Launches, ep: int, mode: str) -> None:
    local = SHAPE["experts"] // ep
    for rank, result in enumerate(runs(2)[f"layout-ep{ep}"]):
        expected = te_layout.expected_te_layout(
            "mlp.experts.",
            ep_rank=rank if ep == 2 else 0,
            ep_size=ep,
            local_experts=local,
            hidden=SHAPE["hidden"],
            ffn=SHAPE["ffn"],
            expert_dp_rank=0 if ep == 2 else rank,
            singleton=mode == "singleton",
        )
        where = f"ep{ep} {mode} rank {rank}"
        unfused = {
            key: [{k: v for k, v in fact.items() if k != "data"} for fact in facts]
            for key, facts in result[f"unfused/{mode}"].items()
        }
        assert unfused == expected, f"{where}: TEGroupedMLP with groupgrad linears"
        for backend in ("fused", "sequential"):
            facts = te_layout.checkpoint_facts(result[f"{backend}/{mode}"])
            assert facts == te_layout.checkpoint_facts(expected), f"{where}: {backend}"
        weights = result["fused/weights"]
        for e in range(local):  # the fused experts' fc1 halves are the weight's gate / up rows
            gate, up = (
                fact["data"]
                for fact in result[f"fused/{mode}"][f"mlp.experts.grouped_mlp.fc1.weight{e}"]
            )
            weight = weights[f"experts.local_experts.{e}.linear_fc1.weight"]
            assert torch.equal(gate, weight[: SHAPE["ffn"]]), f"{where} expert {e}"
            assert torch.equal(up, weight[SHAPE["ffn"] :]), f"{where} expert {e}"


# ---------------------------------------------------------------- parameters


@pytest.mark.parametrize("name", _names(scenarios.INITS))
def test_init_method_per_expert_and_megatron_attributes(runs: Launches, name: str) -> None:
    scenario = next(s for s in scenarios.INITS if s["name"] == name)
    local = SHAPE["experts"] // scenario["ep"]
    fc1_shape, fc2_shape = (2 * SHAPE["ffn"], SHAPE["hidden"]), (SHAPE["hidden"], SHAPE["ffn"])
    for rank, result in enumerate(runs(2)[name]):
        for case, built in result.items():
            where = f"{name} rank {rank} {case}"
            router = (SHAPE["experts"], SHAPE["hidden"])  # the router takes init_method too
            calls = [tuple(call) for call in built["calls"] if tuple(call[1]) != router]
            assert calls == [("fc1", fc1_shape)] * local + [("fc2", fc2_shape)] * local, where
            values: dict[str, list[float]] = {"fc1": [], "fc2": []}
            for param_name, param in built["params"].items():
                fc = "fc1" if "linear_fc1" in param_name else "fc2"
                value = param["value"]
                assert value.unique().numel() == 1, (
                    f"{where}: {param_name} was not set by one init call"
                )
                values[fc].append(float(value.flatten()[0]))
                assert param["allreduce"] is (scenario["ep"] == 1), f"{where}: {param_name}"
                assert param["skip_backward_post_hook"] is scenario["delay"], (
                    f"{where}: {param_name}"
                )
                assert param["tensor_model_parallel"] is True, f"{where}: {param_name}"
                assert param["partition_dim"] == (0 if fc == "fc1" else 1), f"{where}: {param_name}"
            for fc, base in (("fc1", 100.0), ("fc2", 200.0)):  # each expert its own call's value
                assert len(set(values[fc])) == local, f"{where}: {fc} {values[fc]}"
                assert all(base < v < base + 100 for v in values[fc]), f"{where}: {fc} {values[fc]}"


def test_refused_setups_name_the_problem(runs: Launches) -> None:
    for rank, messages in enumerate(runs(2)["errors"]):
        for backend in ("fused", "unfused"):
            etp = messages[f"etp_groups/{backend}"]
            assert "ValueError" in etp, f"rank {rank}: {etp}"
            assert "expert tensor-parallel group (pg_collection.expt_tp) has 2 ranks" in etp
            ddp = messages[f"ddp_without_delay/{backend}"]
            assert ddp.startswith("RuntimeError:"), f"rank {rank}: {ddp}"
            assert "no wgrad hook was registered" in ddp
            assert "DistributedDataParallelConfig(delay_wgrad_compute=True)" in ddp
            # refused before its GEMMs: no expert gradient written (in main_grad or .grad)
            assert messages[f"ddp_without_delay_wrote/{backend}"] == "nothing", f"rank {rank}"
            # Catches: a bare StopIteration (the frozen-weight check finding no frozen weight)
            twice = messages[f"ddp_twice/{backend}"]
            assert twice.startswith("RuntimeError:"), f"rank {rank}: {twice}"
            assert "wrapped in Megatron's DistributedDataParallel more than once" in twice
            assert messages[f"ddp_twice_wrote/{backend}"] == "nothing", f"rank {rank}"


@pytest.mark.parametrize("name", _names(scenarios.PARAM_GATHER))
def test_overlapped_param_gather_changes_no_step(param_gather_runs: Launches, name: str) -> None:
    # Catches: the fused experts running on weights Megatron's overlapped all-gather never
    # refreshed (it waits for a bucket, and starts the next, in the forward pre-hooks of the
    # modules owning its parameters: fc1 and fc2, which the fused MLP never calls) — stale
    # expert weights from the second step on with expert-data-parallel buffers, an
    # AssertionError in Megatron's start_param_sync with several buckets.
    for result in param_gather_runs(2)[name]:
        plain, overlapped = result["plain"], result["overlapped"]
        assert len(plain) == len(overlapped) == 3
        for step, (a, b) in enumerate(zip(plain, overlapped, strict=True)):
            assert torch.equal(a, b), f"step {step}: {(a - b).abs().max()}"
        assert not torch.equal(plain[0], plain[2])  # the optimizer moved the weights


@pytest.mark.parametrize("name", _names(scenarios.ATOMICS))
def test_no_op_that_adds_atomically_on_cuda_in_the_experts_step(runs: Launches, name: str) -> None:
    # Catches: a gather, combine or bias gradient of the experts summed by index_add_ /
    # scatter_add_ (their atomic adds on CUDA change a gradient's bits from run to run).
    for rank, result in enumerate(runs(2)[name]):
        for backend in ("fused", "unfused"):
            where = f"{name} rank {rank} {backend}"
            assert result[f"{backend}/grads"], f"{where}: the backward did not run through"
            assert result[backend] == [], where
