"""groupgrad layers trained under the real Megatron-FSDP by gloo processes, against an fp64 reference.

Each scenario: every rank builds the same ``GroupedMLP(tanh(GroupedLinear(x)))``
model (``accumulate_into_main_grad=True``), shards it with ``shard_model`` /
``shard_optimizer`` and trains 2 SGD steps of 2 micro-batches on data of its
own. The parent checks: the full weights after every step equal a
single-process fp64 reference (so the fp32 wgrads reached Megatron-FSDP's
buffers exactly once per micro-batch, and earlier micro-batches survived);
``get_main_grad()`` ran exactly once per groupgrad weight per backward and
handed out fp32 buffers (a second call would mean ``grad_added_to_main_grad``
was not seen and Megatron-FSDP re-fetched and overwrote the bucket); the
``overwrite_main_grad`` flag the wgrad GEMM saw; every gradient collective ran
in fp32. One scenario uses Megatron-FSDP's bare ``fully_shard_model`` under
ZeRO-1 and shows the pitfall ``shard_model`` fixes: earlier micro-batches are
lost.

One 2-rank launch runs every scenario, plus a 1-rank launch (a data-parallel
group of size 1 leaves every gradient buffer unsharded, even under ZeRO-3).
The ranks run with a test-only CUDA shim (``cpu_shim.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from groupgrad_testsupport import Launches, load_sibling

ref = load_sibling(__file__, "reference")
WORKER = Path(__file__).with_name("mfsdp_worker.py")

SHAPE = {"experts": 3, "hidden": 8, "ffn_hidden": 6, "tokens": 12}
DEFAULTS = {"packed": False, "fixed": True, "steps": 2, "micro_batches": 2, "lr": 0.5}


def scenario(name: str, strategy: str, seed: int, **options: Any) -> dict[str, Any]:
    return {"name": name, **DEFAULTS, **SHAPE, "strategy": strategy, "seed": seed, **options}


TWO_RANKS = [
    scenario("zero3-per_expert", "optim_grads_params", 1),
    scenario("zero3-packed", "optim_grads_params", 2, packed=True),
    scenario("zero2-per_expert", "optim_grads", 3),
    scenario("zero1-per_expert", "optim", 4),
    scenario("zero1-packed", "optim", 5, packed=True),
    scenario("no_shard-per_expert", "no_shard", 6),
    scenario("zero3-bf16", "optim_grads_params", 9, dtype="bfloat16"),
]
ONE_RANK = [scenario("zero3-group_of_one", "optim_grads_params", 7)]
UNFIXED = scenario("zero1-unfixed", "optim", 8, fixed=False)
CASES = [(2, s["name"]) for s in TWO_RANKS] + [(1, s["name"]) for s in ONE_RANK]
# Which overwrite_main_grad the wgrad GEMM must see: True where the gradient
# buffer is sharded (a fresh bucket per backward), False where it persists.
SHARDED = {"zero3-per_expert", "zero3-packed", "zero2-per_expert", "zero3-bf16"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict[str, Any]]:
    """Launch each world size once, at the first test that needs it; a failed launch fails all."""
    return Launches(tmp_path_factory, WORKER, {2: [*TWO_RANKS, UNFIXED], 1: ONE_RANK})


def _ids(case: tuple[int, str]) -> str:
    return f"{case[0]}ranks-{case[1]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_delay_switched_on_after_sharding_is_refused_at_forward(
    runs: Callable[[int], dict[str, Any]], case: tuple
) -> None:
    # Catches: delay_wgrad_compute switched on after shard_model, which trained on garbage
    # (Megatron-FSDP reduced the unwritten bucket at backward, before backward_dw()).
    world, name = case
    for rank, result in enumerate(runs(world)[name]):
        assert result["switched_delay_error"] is not None, f"{name} rank {rank}: not refused"
        assert result["switched_delay_error"].startswith(
            "GroupedMLP 'mlp' has delay_wgrad_compute=True, expected False under Megatron-FSDP"
        ), result["switched_delay_error"]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_weights_match_fp64_reference(runs: Callable[[int], dict[str, Any]], case: tuple) -> None:
    world, name = case
    ranks = runs(world)[name]
    if ranks[0]["config"].get("dtype") == "bfloat16":
        ref.check_weights_bf16(ranks)
        return
    ref.check_weights(ranks, ref.expected_weights(ranks))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_wgrads_go_through_get_main_grad_once_in_fp32(
    runs: Callable[[int], dict[str, Any]], case: tuple
) -> None:
    world, name = case
    ranks = runs(world)[name]
    sharded = name in SHARDED and world > 1
    ref.check_main_grad_calls(ranks, overwrite=sharded)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gradient_collectives_are_fp32(runs: Callable[[int], dict[str, Any]], case: tuple) -> None:
    world, name = case
    for rank, result in enumerate(runs(world)[name]):
        collectives = result["collectives"]
        if world > 1:
            assert collectives, f"{name} rank {rank}: no gradient collective ran"
        for entry in collectives:
            assert entry["dtype"] == "torch.float32", f"{name} rank {rank}: {entry}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gathered_full_weights_and_grads_match_the_reference(
    runs: Callable[[int], dict[str, Any]], case: tuple
) -> None:
    world, name = case
    ref.check_gathered(runs(world)[name])


def test_gathering_covers_ranks_whose_shard_is_empty(
    runs: Callable[[int], dict[str, Any]],
) -> None:
    """Such a rank has ``.grad = None``; the gradient is still whole (checked above)."""
    ranks = runs(2)["zero3-per_expert"]
    empty = [
        (rank, param)
        for rank, result in enumerate(ranks)
        for param, numel in result["shard_numels"].items()
        if numel == 0
    ]
    assert empty, "no rank holds an empty shard here: the empty-shard case would go untested"
    for rank, param in empty:
        assert param in ranks[rank]["gathered_grads"][-1], (rank, param)


def test_bare_fully_shard_model_drops_micro_batches_under_zero1(
    runs: Callable[[int], dict[str, Any]],
) -> None:
    """Without shard_model's fix, ZeRO-1 overwrites the persistent buffer every micro-batch."""
    ranks = runs(2)[UNFIXED["name"]]
    ref.check_main_grad_calls(ranks, overwrite=True)
    ref.check_weights(ranks, ref.expected_weights(ranks, last_micro_only=True))
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        ref.check_weights(ranks, ref.expected_weights(ranks))
